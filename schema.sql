-- paysync schema for MySQL 8 / MariaDB 10.6+ (InnoDB, utf8mb4).
-- Generated from payments/infra/schema.py by `python -m payments schema-sql`; do not edit by hand.
-- tests/test_schema.py checks that this file, applied to MariaDB, matches init-db.

CREATE TABLE alert (
	id BIGINT NOT NULL AUTO_INCREMENT,
	rule VARCHAR(64) NOT NULL COMMENT 'callback_backlog, callback_failure_rate, callback_gave_up, …',
	dedupe_key VARCHAR(191) NOT NULL,
	open_key VARCHAR(191) COMMENT '= dedupe_key while pending/firing, NULL once resolved',
	severity VARCHAR(16) NOT NULL,
	status VARCHAR(16) NOT NULL COMMENT 'pending (condition seen, not long enough), firing, resolved',
	message VARCHAR(500) NOT NULL,
	details TEXT COMMENT 'JSON',
	first_seen_at DATETIME(6) NOT NULL,
	last_seen_at DATETIME(6) NOT NULL,
	fired_at DATETIME(6),
	resolved_at DATETIME(6),
	notified_at DATETIME(6) COMMENT 'when channels were last told',
	acked_at DATETIME(6) COMMENT 'a person took it: no more reminders for this incident',
	acked_by VARCHAR(64) COMMENT 'who acknowledged it (ops_action has the rest)',
	silenced_until DATETIME(6) COMMENT 'no notice about it is sent before this time',
	assignee VARCHAR(64) COMMENT 'who is on it',
	PRIMARY KEY (id),
	CONSTRAINT uq_alert_open_key UNIQUE (open_key)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Alerts: at most one open row per dedupe key; resolved rows stay as history.' COLLATE utf8mb4_bin;

CREATE INDEX idx_alert_status ON alert (status);

CREATE TABLE alert_notification (
	id BIGINT NOT NULL AUTO_INCREMENT,
	alert_id BIGINT NOT NULL COMMENT 'alert.id this notification is about',
	channel VARCHAR(16) NOT NULL COMMENT 'email, sms, aliyun_sms, dingtalk, feishu, wecom, slack, webhook',
	kind VARCHAR(16) NOT NULL COMMENT 'firing (once per incident), repeat (each cooldown), resolved',
	seq INTEGER NOT NULL COMMENT 'repeat number (1, 2, …); 0 for firing and resolved',
	status VARCHAR(16) NOT NULL COMMENT 'held (resolved notice waiting for the alert to clear), pending, sent, gave_up, cancelled',
	attempts INTEGER NOT NULL COMMENT 'failed attempts so far',
	next_attempt_at DATETIME(6) NOT NULL COMMENT 'earliest time a notifier may try (backoff after a failure)',
	lease_until DATETIME(6) COMMENT 'a notifier is sending it until then (claimed, SKIP LOCKED)',
	last_error VARCHAR(500) COMMENT 'why the last attempt failed (no URL, no secret)',
	sent_at DATETIME(6),
	created_at DATETIME(6) NOT NULL,
	updated_at DATETIME(6) NOT NULL,
	group_key VARCHAR(191) COMMENT 'firing notices of one cause share it (payment:<id> or group:<rule group>): one notice for them all',
	grouped_into BIGINT COMMENT 'alert_notification.id of the notice that carries this one; it is never sent by itself',
	PRIMARY KEY (id),
	CONSTRAINT uq_alert_notification UNIQUE (alert_id, channel, kind, seq),
	CONSTRAINT ck_alert_notification_kind CHECK (kind IN ('firing', 'repeat', 'resolved')),
	CONSTRAINT ck_alert_notification_status CHECK (status IN ('held', 'pending', 'sent', 'gave_up', 'cancelled'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Per alert, channel and kind: the delivery state of notifications, so one dead channel never holds up another.' COLLATE utf8mb4_bin;

CREATE INDEX idx_alert_notification_due ON alert_notification (status, next_attempt_at);

CREATE INDEX idx_alert_notification_group ON alert_notification (group_key, channel);

CREATE INDEX idx_alert_notification_grouped_into ON alert_notification (grouped_into);

CREATE TABLE callback_attempt (
	id BIGINT NOT NULL AUTO_INCREMENT,
	callback_log_id BIGINT NOT NULL COMMENT 'payment_callback_log.id this attempt processed',
	outcome VARCHAR(16) NOT NULL COMMENT 'what processing did: applied, noop, duplicate, conflict, rejected, retry, gave_up, replayed',
	status SMALLINT NOT NULL COMMENT 'the row''s status after this attempt (0-4)',
	result VARCHAR(500) COMMENT 'what processing said (the row''s result then)',
	attempt_by VARCHAR(64) COMMENT 'who ran it: web, consumer, compensator, or the replayer',
	created_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Every processing attempt of a callback and what it said, one row each; only ever inserted.' COLLATE utf8mb4_bin;

CREATE INDEX idx_callback_attempt_log ON callback_attempt (callback_log_id, id);

CREATE TABLE event_delivery (
	id BIGINT NOT NULL AUTO_INCREMENT,
	event_id VARCHAR(40) NOT NULL COMMENT 'outbox.event_id of a domain event',
	destination VARCHAR(16) NOT NULL COMMENT 'amqp (the paysync.events exchange) or webhook',
	status SMALLINT NOT NULL COMMENT '0 pending 1 delivered 2 gave up (manual)',
	attempts INTEGER NOT NULL COMMENT 'failed attempts so far',
	next_attempt_at DATETIME(6) NOT NULL,
	last_error VARCHAR(500),
	last_http_status SMALLINT COMMENT 'webhook: the merchant''s last answer',
	delivered_at DATETIME(6),
	created_at DATETIME(6) NOT NULL,
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_event_delivery UNIQUE (event_id, destination),
	CONSTRAINT ck_event_delivery_status CHECK (status IN (0, 1, 2))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Per-destination delivery state of domain events, so one destination''s outage never re-sends the other.' COLLATE utf8mb4_bin;

CREATE TABLE idempotency_request (
	id BIGINT NOT NULL AUTO_INCREMENT,
	scope VARCHAR(32) NOT NULL COMMENT 'the endpoint family, e.g. payments',
	idempotency_key VARCHAR(255) NOT NULL,
	request_digest VARCHAR(64) NOT NULL COMMENT 'sha256 of the canonical request',
	status VARCHAR(16) NOT NULL COMMENT 'started (in flight), done',
	response_status SMALLINT,
	response_body TEXT COMMENT 'the first answer, replayed verbatim',
	payment_id VARCHAR(40),
	locked_at DATETIME(6) NOT NULL COMMENT 'a started request older than the lock timeout may be taken over',
	created_at DATETIME(6) NOT NULL,
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_idempotency_request_key UNIQUE (scope, idempotency_key),
	CONSTRAINT ck_idempotency_request_status CHECK (status IN ('started', 'done'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Merchant Idempotency-Key records: in-flight detection (409) and replay of the first answer.' COLLATE utf8mb4_bin;

CREATE TABLE ledger_entry (
	id BIGINT NOT NULL AUTO_INCREMENT,
	ledger_event_id BIGINT NOT NULL,
	account VARCHAR(64) NOT NULL,
	amount_minor BIGINT NOT NULL COMMENT 'signed: debit > 0, credit < 0; an event''s lines sum to 0',
	currency VARCHAR(3) NOT NULL,
	PRIMARY KEY (id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Double-entry lines of ledger events; append-only like ledger_event.' COLLATE utf8mb4_bin;

CREATE INDEX idx_ledger_entry_account ON ledger_entry (account);

CREATE INDEX idx_ledger_entry_event ON ledger_entry (ledger_event_id);

CREATE TABLE ledger_event (
	id BIGINT NOT NULL AUTO_INCREMENT,
	event_type VARCHAR(40) NOT NULL COMMENT 'PaymentRequested, PaymentConfirmed, PaymentFailed, Refund…, ReconciliationAdjusted',
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	amount_minor BIGINT NOT NULL,
	currency VARCHAR(3) NOT NULL,
	source_type VARCHAR(32) NOT NULL COMMENT 'api, callback, provider_call, query, reconciliation',
	source_id VARCHAR(64),
	dedupe_key VARCHAR(191) NOT NULL COMMENT 'one business effect, one row: e.g. PaymentConfirmed:pay_…',
	details TEXT COMMENT 'JSON: the path walked, the previous status, …',
	created_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_ledger_event_dedupe UNIQUE (dedupe_key)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Append-only business events; UPDATE and DELETE are refused by triggers.' COLLATE utf8mb4_bin;

CREATE INDEX idx_ledger_event_payment ON ledger_event (payment_id);

CREATE INDEX idx_ledger_event_type_time ON ledger_event (event_type, created_at);

CREATE TABLE ledger_seal (
	seq BIGINT NOT NULL COMMENT 'position in the chain: 1, 2, 3, … without gaps',
	ledger_event_id BIGINT NOT NULL COMMENT 'the sealed event (each event is sealed once)',
	event_digest VARCHAR(64) NOT NULL COMMENT 'sha256 of the event''s canonical content and lines',
	prev_hash VARCHAR(64) NOT NULL COMMENT 'chain_hash of seq - 1 (64 zeros for seq 1)',
	chain_hash VARCHAR(64) NOT NULL COMMENT 'sha256 of prev_hash, seq, event id, digest',
	max_event_id BIGINT NOT NULL COMMENT 'highest ledger_event_id sealed up to this seq: new events are the ids above it',
	sealed_at DATETIME(6) NOT NULL,
	PRIMARY KEY (seq),
	CONSTRAINT uq_ledger_seal_event UNIQUE (ledger_event_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Tamper evidence: a SHA-256 chain over ledger events in the order the sealer saw them committed.' COLLATE utf8mb4_bin;

CREATE TABLE ledger_seal_gap (
	id BIGINT NOT NULL AUTO_INCREMENT,
	from_event_id BIGINT NOT NULL COMMENT 'first ledger_event id the sealer skipped',
	to_event_id BIGINT NOT NULL COMMENT 'last one (a range: ids are not always dense)',
	noticed_at DATETIME(6) NOT NULL COMMENT 'watched for late commits until LATE_COMMIT_SECONDS after this',
	PRIMARY KEY (id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Work list of the sealer: ids skipped while sealing in id order (uncommitted then, or rolled back).' COLLATE utf8mb4_bin;

CREATE INDEX idx_ledger_seal_gap_noticed ON ledger_seal_gap (noticed_at);

CREATE TABLE manual_review (
	id BIGINT NOT NULL AUTO_INCREMENT,
	kind VARCHAR(40) NOT NULL COMMENT 'callback_gave_up, conflicting_report, unresolved_payment, …',
	subject VARCHAR(150) COMMENT 'what it is about: payment:<id>, refund:<id>, callback:<id>, event:<id>:<destination>',
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	callback_log_id BIGINT,
	reason VARCHAR(500) NOT NULL,
	details TEXT COMMENT 'JSON',
	status VARCHAR(16) NOT NULL COMMENT 'open, resolved',
	open_key VARCHAR(191) COMMENT '<kind>:<subject> while open, NULL once resolved: one open review per subject',
	occurrences INTEGER NOT NULL COMMENT 'how often the subject was escalated while open',
	resolution VARCHAR(500),
	resolved_by VARCHAR(64),
	created_at DATETIME(6) NOT NULL,
	last_seen_at DATETIME(6) NOT NULL COMMENT 'the latest escalation of this subject',
	resolved_at DATETIME(6),
	alert_key VARCHAR(191) COMMENT 'dedupe key of the alert the review raised: resolving the review resolves it',
	acked_at DATETIME(6) COMMENT 'a person took it (its alert stops reminding too)',
	acked_by VARCHAR(64),
	silenced_until DATETIME(6) COMMENT 'its alert sends no notice before this time',
	assignee VARCHAR(64) COMMENT 'who is on it',
	PRIMARY KEY (id),
	CONSTRAINT uq_manual_review_open_key UNIQUE (open_key)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='The manual queue: what automation refused to decide.' COLLATE utf8mb4_bin;

CREATE INDEX idx_manual_review_payment ON manual_review (payment_id);

CREATE INDEX idx_manual_review_status ON manual_review (status, created_at);

CREATE TABLE ops_action (
	id BIGINT NOT NULL AUTO_INCREMENT,
	action VARCHAR(16) NOT NULL COMMENT 'replay, apply, adjust, close, ack, silence, assign',
	actor VARCHAR(64) NOT NULL COMMENT 'who: the name given at console login, or --actor',
	identity VARCHAR(160) COMMENT 'who, as authenticated: the console session and its token, or the command''s OS user',
	ops_session_id BIGINT COMMENT 'the console session that acted (ops_session.id)',
	via VARCHAR(16) NOT NULL COMMENT 'console or cli',
	subject VARCHAR(150) NOT NULL COMMENT 'what it acted on: callback:<id> or review:<id>',
	manual_review_id BIGINT,
	callback_log_id BIGINT,
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	reason VARCHAR(500) NOT NULL COMMENT 'why: the operator''s note',
	outcome VARCHAR(500) NOT NULL COMMENT 'what it did',
	details TEXT COMMENT 'JSON: previous status, ledger event posted, provider call, …',
	created_at DATETIME(6) NOT NULL,
	alert_id BIGINT COMMENT 'the alert acted on (ack, silence, assign)',
	PRIMARY KEY (id),
	CONSTRAINT ck_ops_action_action CHECK (action IN ('replay', 'apply', 'adjust', 'close', 'ack', 'silence', 'assign'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Every ops console and review-command action: who, when, why and what it did; append-only (triggers).' COLLATE utf8mb4_bin;

CREATE INDEX idx_ops_action_alert ON ops_action (alert_id);

CREATE INDEX idx_ops_action_callback ON ops_action (callback_log_id);

CREATE INDEX idx_ops_action_created ON ops_action (created_at);

CREATE INDEX idx_ops_action_payment ON ops_action (payment_id);

CREATE INDEX idx_ops_action_review ON ops_action (manual_review_id);

CREATE TABLE ops_session (
	id BIGINT NOT NULL AUTO_INCREMENT,
	sid_hash VARCHAR(64) NOT NULL COMMENT 'SHA-256 (hex) of the session id in the signed cookie',
	`role` VARCHAR(16) NOT NULL COMMENT 'operator or readonly',
	actor VARCHAR(64) NOT NULL COMMENT 'the name typed at login',
	token_fingerprint VARCHAR(32) NOT NULL COMMENT 'which ops token logged in (gateway.ops.fingerprint)',
	remote_addr VARCHAR(64) COMMENT 'the client''s address at login',
	created_at DATETIME(6) NOT NULL,
	expires_at DATETIME(6) NOT NULL COMMENT 'login time plus the session lifetime (12 h)',
	revoked_at DATETIME(6) COMMENT 'logout: the cookie is worth nothing from then on',
	PRIMARY KEY (id),
	CONSTRAINT uq_ops_session_sid_hash UNIQUE (sid_hash)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Ops console logins: a session is valid only while its row is unexpired and not revoked (logout).' COLLATE utf8mb4_bin;

CREATE INDEX idx_ops_session_expires ON ops_session (expires_at);

CREATE TABLE outbox (
	id BIGINT NOT NULL AUTO_INCREMENT,
	event_id VARCHAR(40) NOT NULL COMMENT 'unique id receivers dedupe on (evt_<ULID>)',
	event_type VARCHAR(64) NOT NULL COMMENT 'ChargeRequested, RefundRequested, PaymentSucceeded, …',
	aggregate_id VARCHAR(40) NOT NULL COMMENT 'payment_id or refund_id',
	payload TEXT NOT NULL COMMENT 'JSON',
	status SMALLINT NOT NULL COMMENT '0 pending 1 done 2 dead (manual)',
	attempts INTEGER NOT NULL,
	next_attempt_at DATETIME(6) NOT NULL,
	last_error VARCHAR(500),
	created_at DATETIME(6) NOT NULL,
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_outbox_event_id UNIQUE (event_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Work to send, written in the same transaction as the change that caused it.' COLLATE utf8mb4_bin;

CREATE INDEX idx_outbox_aggregate ON outbox (aggregate_id);

CREATE INDEX idx_outbox_due ON outbox (status, next_attempt_at);

CREATE TABLE payment (
	id BIGINT NOT NULL AUTO_INCREMENT,
	payment_id VARCHAR(40) NOT NULL COMMENT 'business number, fixed for life (pay_<ULID>)',
	order_no VARCHAR(64) NOT NULL COMMENT 'the merchant''s order number',
	amount_minor BIGINT NOT NULL COMMENT 'integer minor units',
	currency VARCHAR(3) NOT NULL,
	provider VARCHAR(32) NOT NULL,
	provider_transaction_id VARCHAR(128),
	status VARCHAR(16) NOT NULL,
	idempotency_key VARCHAR(255) COMMENT 'the merchant''s key; also sent to the provider',
	request_digest VARCHAR(64) COMMENT 'sha256 of the canonical create request',
	description VARCHAR(500),
	error_code VARCHAR(64),
	status_source VARCHAR(128) COMMENT 'what caused the last status change: callback:<id>, call:<id>, query:<id>',
	next_query_at DATETIME(6),
	query_attempts INTEGER NOT NULL,
	deadline_at DATETIME(6) COMMENT 'after this an unresolved payment goes to manual review',
	qr_code VARCHAR(512) COMMENT 'what the buyer scans (Alipay qr_code, WeChat code_url)',
	payment_method VARCHAR(255) COMMENT 'what the provider is to charge, as the merchant named it (Stripe: a PaymentMethod id pm_…)',
	created_at DATETIME(6) NOT NULL,
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_payment_payment_id UNIQUE (payment_id),
	CONSTRAINT uq_payment_provider_txn UNIQUE (provider_transaction_id),
	CONSTRAINT uq_payment_idempotency_key UNIQUE (idempotency_key),
	CONSTRAINT ck_payment_amount_positive CHECK (amount_minor > 0),
	CONSTRAINT ck_payment_status CHECK (status IN ('Created', 'Pending', 'Succeeded', 'Failed', 'Unknown'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='One row per payment; status changes only through the state machine''s guarded UPDATEs.' COLLATE utf8mb4_bin;

CREATE INDEX idx_payment_order_no ON payment (order_no);

CREATE INDEX idx_payment_status_query ON payment (status, next_query_at);

CREATE TABLE payment_callback_log (
	id BIGINT NOT NULL AUTO_INCREMENT,
	provider VARCHAR(32) NOT NULL COMMENT 'provider name from the URL',
	callback_data MEDIUMBLOB NOT NULL COMMENT 'raw request body, byte for byte',
	headers TEXT NOT NULL COMMENT 'JSON object of the selected request headers',
	remote_addr VARCHAR(64),
	source VARCHAR(16) NOT NULL COMMENT 'webhook: POSTed to the gateway (signature checked); api: fetched by paysync from the provider''s API' DEFAULT 'webhook',
	order_no VARCHAR(64) COMMENT 'our payment_id (or refund_id) named by the callback',
	payment_order_no VARCHAR(128) COMMENT 'the provider''s transaction id',
	provider_event_id VARCHAR(128),
	event_type VARCHAR(64),
	status SMALLINT NOT NULL COMMENT '0 pending 1 processed 2 failed 3 rejected 4 gave up',
	result VARCHAR(500) COMMENT 'what processing did, or why it failed',
	retry_count INTEGER NOT NULL,
	last_retry_time DATETIME(6),
	next_retry_at DATETIME(6) NOT NULL COMMENT 'earliest time a sweep may take the row',
	create_time DATETIME(6) NOT NULL,
	update_time DATETIME(6) NOT NULL,
	request_id VARCHAR(64) COMMENT 'the gateway request that stored it (X-Request-Id): log lines of every process carry it',
	PRIMARY KEY (id),
	CONSTRAINT ck_callback_status CHECK (status IN (0, 1, 2, 3, 4))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Every callback delivery exactly as received; the truth the consumer and compensator work from.' COLLATE utf8mb4_bin;

CREATE INDEX idx_callback_create_time ON payment_callback_log (create_time);

CREATE INDEX idx_callback_event ON payment_callback_log (provider, provider_event_id);

CREATE INDEX idx_callback_order_no ON payment_callback_log (order_no);

CREATE INDEX idx_callback_sweep ON payment_callback_log (status, next_retry_at);

CREATE TABLE processed_event (
	id BIGINT NOT NULL AUTO_INCREMENT,
	provider VARCHAR(32) NOT NULL,
	provider_event_id VARCHAR(128) NOT NULL,
	callback_log_id BIGINT NOT NULL COMMENT 'the delivery that was applied',
	processed_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_processed_event UNIQUE (provider, provider_event_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='The inbox: one row per provider event ever applied; makes processing idempotent.' COLLATE utf8mb4_bin;

CREATE TABLE provider_breaker (
	provider VARCHAR(32) NOT NULL,
	state VARCHAR(16) NOT NULL COMMENT 'closed, open',
	consecutive_failures INTEGER NOT NULL,
	open_count INTEGER NOT NULL COMMENT 'opens since it last closed: drives the backoff',
	opened_at DATETIME(6),
	retry_at DATETIME(6) COMMENT 'while open: when the next probe may go out',
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (provider),
	CONSTRAINT ck_provider_breaker_state CHECK (state IN ('closed', 'open'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Circuit breaker per provider, shared by every compensator process.' COLLATE utf8mb4_bin;

CREATE TABLE provider_call (
	id BIGINT NOT NULL AUTO_INCREMENT,
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	provider VARCHAR(32) NOT NULL,
	operation VARCHAR(16) NOT NULL COMMENT 'charge, query, refund, settlement',
	idempotency_key VARCHAR(255) COMMENT 'the key sent with the call, if any',
	request_digest VARCHAR(64) NOT NULL COMMENT 'sha256 of the canonical request parameters',
	http_status SMALLINT COMMENT 'NULL: no HTTP answer (timeout, reset)',
	response TEXT COMMENT 'raw answer, scrubbed of secrets and truncated',
	error_code VARCHAR(64) COMMENT 'decline code or why the answer was Unknown',
	latency_ms INTEGER,
	outcome VARCHAR(16) COMMENT 'Succeeded, Failed, Pending, Unknown, Mismatch, NotFound; NULL: sent, no outcome recorded (crash)',
	started_at DATETIME(6) NOT NULL COMMENT 'written and committed before the request goes out',
	finished_at DATETIME(6),
	PRIMARY KEY (id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Evidence of every outbound call; payment.status_source names the call:<id> or query:<id> that moved it.' COLLATE utf8mb4_bin;

CREATE INDEX idx_provider_call_payment ON provider_call (payment_id);

CREATE INDEX idx_provider_call_refund ON provider_call (refund_id);

CREATE INDEX idx_provider_call_started ON provider_call (started_at);

CREATE TABLE provider_cursor (
	provider VARCHAR(32) NOT NULL,
	name VARCHAR(64) NOT NULL COMMENT 'what the cursor tracks, e.g. events',
	value VARCHAR(255) NOT NULL COMMENT 'where the job left off, e.g. a unix time',
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (provider, name)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Where a job reading a provider''s API left off (Stripe catch_up: created time of the newest event listed).' COLLATE utf8mb4_bin;

CREATE TABLE query_hint (
	provider VARCHAR(32) NOT NULL COMMENT 'the adapter the payment was made through',
	payment_id VARCHAR(40) NOT NULL,
	hinted_at DATETIME(6) NOT NULL COMMENT 'when a hint last brought the payment''s query forward',
	callback_log_id BIGINT COMMENT 'the refused delivery that hinted it',
	PRIMARY KEY (provider, payment_id)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Unverified notifications that scheduled a query (payments.hints): the per-payment and per-provider rate limits read it.' COLLATE utf8mb4_bin;

CREATE INDEX idx_query_hint_provider_time ON query_hint (provider, hinted_at);

CREATE TABLE reconciliation_item (
	id BIGINT NOT NULL AUTO_INCREMENT,
	run_id BIGINT NOT NULL,
	category VARCHAR(24) NOT NULL,
	kind VARCHAR(16) NOT NULL COMMENT 'charge, refund, fee, invalid',
	settlement_file_id BIGINT COMMENT 'NULL for local_only items',
	line_no INTEGER,
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	provider_reference VARCHAR(128),
	merchant_reference VARCHAR(128),
	currency VARCHAR(3),
	provider_amount_minor BIGINT,
	local_amount_minor BIGINT,
	fee_minor BIGINT,
	provider_status VARCHAR(16),
	local_status VARCHAR(16) COMMENT 'the local status when the line was matched',
	action VARCHAR(16) NOT NULL COMMENT 'none, resolved, adjusted, review',
	manual_review_id BIGINT,
	details TEXT COMMENT 'JSON: why, the adjustment posted, …',
	created_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT ck_reconciliation_item_category CHECK (category IN ('matched', 'resolved', 'amount_mismatch', 'status_mismatch', 'provider_only', 'local_only', 'fee', 'ignored', 'unreadable'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='The result for each settlement line (and each local-only success) of a run; the source of its effects.' COLLATE utf8mb4_bin;

CREATE INDEX idx_reconciliation_item_payment ON reconciliation_item (payment_id);

CREATE INDEX idx_reconciliation_item_run ON reconciliation_item (run_id, category);

CREATE TABLE reconciliation_run (
	id BIGINT NOT NULL AUTO_INCREMENT,
	provider VARCHAR(32) NOT NULL,
	settlement_date DATE NOT NULL,
	settlement_file_id BIGINT,
	started_by VARCHAR(16) NOT NULL COMMENT 'daily (the compensator) or manual (the command)',
	status VARCHAR(16) NOT NULL COMMENT 'running, completed, failed',
	line_count INTEGER NOT NULL COMMENT 'records read from the file',
	new_lines INTEGER NOT NULL COMMENT 'records stored by this run (0: seen before)',
	resolved INTEGER NOT NULL COMMENT 'payments and refunds moved by the state machine',
	adjustments INTEGER NOT NULL COMMENT 'ReconciliationAdjusted events posted',
	reviews INTEGER NOT NULL COMMENT 'manual reviews opened',
	summary TEXT COMMENT 'JSON: count and amounts per currency for each category; fees',
	error VARCHAR(500),
	started_at DATETIME(6) NOT NULL,
	finished_at DATETIME(6),
	PRIMARY KEY (id),
	CONSTRAINT ck_reconciliation_run_status CHECK (status IN ('running', 'completed', 'failed'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='One reconciliation of one provider''s day: the summary an operator reads first.' COLLATE utf8mb4_bin;

CREATE INDEX idx_reconciliation_run_day ON reconciliation_run (provider, settlement_date);

CREATE TABLE refund (
	id BIGINT NOT NULL AUTO_INCREMENT,
	refund_id VARCHAR(40) NOT NULL COMMENT 'business number, fixed for life (re_<ULID>)',
	payment_id VARCHAR(40) NOT NULL,
	amount_minor BIGINT NOT NULL,
	currency VARCHAR(3) NOT NULL,
	provider VARCHAR(32) NOT NULL,
	provider_refund_id VARCHAR(128),
	status VARCHAR(16) NOT NULL,
	idempotency_key VARCHAR(255),
	request_digest VARCHAR(64),
	error_code VARCHAR(64),
	status_source VARCHAR(128),
	next_query_at DATETIME(6),
	query_attempts INTEGER NOT NULL,
	deadline_at DATETIME(6),
	reason VARCHAR(500) COMMENT 'why the merchant refunds, as given to POST …/refunds',
	created_at DATETIME(6) NOT NULL,
	updated_at DATETIME(6) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_refund_refund_id UNIQUE (refund_id),
	CONSTRAINT uq_refund_provider_refund_id UNIQUE (provider_refund_id),
	CONSTRAINT uq_refund_idempotency_key UNIQUE (idempotency_key),
	CONSTRAINT ck_refund_amount_positive CHECK (amount_minor > 0),
	CONSTRAINT ck_refund_status CHECK (status IN ('Created', 'Pending', 'Succeeded', 'Failed', 'Unknown'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='One row per refund; same state machine as payments.' COLLATE utf8mb4_bin;

CREATE INDEX idx_refund_payment ON refund (payment_id);

CREATE INDEX idx_refund_status_query ON refund (status, next_query_at);

CREATE TABLE settlement_file (
	id BIGINT NOT NULL AUTO_INCREMENT,
	provider VARCHAR(32) NOT NULL,
	settlement_date DATE NOT NULL COMMENT 'the day the provider''s file covers',
	format VARCHAR(32) NOT NULL COMMENT 'the parser that read it, e.g. sandbox_csv',
	source VARCHAR(500) NOT NULL COMMENT 'download (through the adapter) or file:<path>',
	sha256 VARCHAR(64) NOT NULL COMMENT 'of the file''s bytes exactly as received',
	size_bytes BIGINT NOT NULL,
	line_count INTEGER COMMENT 'records stored; NULL until the import finished',
	status VARCHAR(16) NOT NULL COMMENT 'importing, imported',
	superseded_at DATETIME(6) COMMENT 'set when a newer file for the same day was imported',
	created_at DATETIME(6) NOT NULL,
	imported_at DATETIME(6),
	PRIMARY KEY (id),
	CONSTRAINT uq_settlement_file UNIQUE (provider, settlement_date, sha256),
	CONSTRAINT ck_settlement_file_status CHECK (status IN ('importing', 'imported'))
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Each provider settlement file imported: what, from where, its digest; the same bytes are imported once.' COLLATE utf8mb4_bin;

CREATE TABLE settlement_line (
	id BIGINT NOT NULL AUTO_INCREMENT,
	settlement_file_id BIGINT NOT NULL,
	line_no INTEGER NOT NULL COMMENT 'line of the file the record starts on (1-based)',
	kind VARCHAR(16) NOT NULL COMMENT 'charge, refund, fee, info (header, totals), invalid',
	status VARCHAR(16) COMMENT 'succeeded, failed (normalised)',
	provider_reference VARCHAR(128) COMMENT 'the provider''s transaction (or refund) id',
	merchant_reference VARCHAR(128) COMMENT 'our payment_id (or refund_id)',
	amount_minor BIGINT COMMENT 'magnitude in minor units; kind says the direction',
	fee_minor BIGINT COMMENT 'fee the provider took (negative: returned)',
	currency VARCHAR(3),
	occurred_at DATETIME(6),
	parse_error VARCHAR(255) COMMENT 'why an invalid line could not be read',
	settlement_amount_minor BIGINT COMMENT 'cross-currency lines: the magnitude that reached our balance (and fee_minor''s currency)',
	settlement_currency VARCHAR(3) COMMENT 'cross-currency lines: the balance''s currency (amount_minor and currency are the charge''s)',
	exchange_rate VARCHAR(32) COMMENT 'cross-currency lines: the provider''s rate, as written (amount x rate = settlement amount)',
	raw MEDIUMTEXT NOT NULL COMMENT 'the record exactly as in the file, without its line ending',
	PRIMARY KEY (id),
	CONSTRAINT uq_settlement_line UNIQUE (settlement_file_id, line_no)
)ENGINE=InnoDB CHARSET=utf8mb4 COMMENT='Every record of every settlement file, unchanged, with its normalised fields; append-only.' COLLATE utf8mb4_bin;

CREATE INDEX idx_settlement_line_merchant_ref ON settlement_line (merchant_reference, kind, settlement_file_id);

CREATE INDEX idx_settlement_line_provider_ref ON settlement_line (provider_reference, kind, settlement_file_id);

CREATE TRIGGER IF NOT EXISTS ledger_event_no_update BEFORE UPDATE ON ledger_event FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_event is append-only';

CREATE TRIGGER IF NOT EXISTS ledger_event_no_delete BEFORE DELETE ON ledger_event FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_event is append-only';

CREATE TRIGGER IF NOT EXISTS ledger_entry_no_update BEFORE UPDATE ON ledger_entry FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_entry is append-only';

CREATE TRIGGER IF NOT EXISTS ledger_entry_no_delete BEFORE DELETE ON ledger_entry FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_entry is append-only';

CREATE TRIGGER IF NOT EXISTS ledger_seal_no_update BEFORE UPDATE ON ledger_seal FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_seal is append-only';

CREATE TRIGGER IF NOT EXISTS ledger_seal_no_delete BEFORE DELETE ON ledger_seal FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_seal is append-only';

CREATE TRIGGER IF NOT EXISTS settlement_line_no_update BEFORE UPDATE ON settlement_line FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'settlement_line is append-only';

CREATE TRIGGER IF NOT EXISTS settlement_line_no_delete BEFORE DELETE ON settlement_line FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'settlement_line is append-only';

CREATE TRIGGER IF NOT EXISTS ops_action_no_update BEFORE UPDATE ON ops_action FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ops_action is append-only';

CREATE TRIGGER IF NOT EXISTS ops_action_no_delete BEFORE DELETE ON ops_action FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ops_action is append-only';

