-- The SQLite schema that init-db created before migrations (commit 135280c), dumped from sqlite_master.
-- tests/test_migrations.py builds an unversioned database from it; never regenerate it.

CREATE TABLE payment_callback_log (
	id INTEGER NOT NULL,
	provider VARCHAR(32) NOT NULL,
	callback_data BLOB NOT NULL,
	headers TEXT NOT NULL,
	remote_addr VARCHAR(64),
	order_no VARCHAR(64),
	payment_order_no VARCHAR(128),
	provider_event_id VARCHAR(128),
	event_type VARCHAR(64),
	status SMALLINT NOT NULL,
	result VARCHAR(500),
	retry_count INTEGER NOT NULL,
	last_retry_time DATETIME,
	next_retry_at DATETIME NOT NULL,
	create_time DATETIME NOT NULL,
	update_time DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT ck_callback_status CHECK (status IN (0, 1, 2, 3, 4))
);

CREATE TABLE payment (
	id INTEGER NOT NULL,
	payment_id VARCHAR(40) NOT NULL,
	order_no VARCHAR(64) NOT NULL,
	amount_minor BIGINT NOT NULL,
	currency VARCHAR(3) NOT NULL,
	provider VARCHAR(32) NOT NULL,
	provider_transaction_id VARCHAR(128),
	status VARCHAR(16) NOT NULL,
	idempotency_key VARCHAR(255),
	request_digest VARCHAR(64),
	description VARCHAR(500),
	error_code VARCHAR(64),
	status_source VARCHAR(128),
	next_query_at DATETIME,
	query_attempts INTEGER NOT NULL,
	deadline_at DATETIME,
	created_at DATETIME NOT NULL,
	updated_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_payment_payment_id UNIQUE (payment_id),
	CONSTRAINT uq_payment_provider_txn UNIQUE (provider_transaction_id),
	CONSTRAINT uq_payment_idempotency_key UNIQUE (idempotency_key),
	CONSTRAINT ck_payment_amount_positive CHECK (amount_minor > 0),
	CONSTRAINT ck_payment_status CHECK (status IN ('Created', 'Pending', 'Succeeded', 'Failed', 'Unknown'))
);

CREATE TABLE refund (
	id INTEGER NOT NULL,
	refund_id VARCHAR(40) NOT NULL,
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
	next_query_at DATETIME,
	query_attempts INTEGER NOT NULL,
	deadline_at DATETIME,
	created_at DATETIME NOT NULL,
	updated_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_refund_refund_id UNIQUE (refund_id),
	CONSTRAINT uq_refund_provider_refund_id UNIQUE (provider_refund_id),
	CONSTRAINT uq_refund_idempotency_key UNIQUE (idempotency_key),
	CONSTRAINT ck_refund_amount_positive CHECK (amount_minor > 0),
	CONSTRAINT ck_refund_status CHECK (status IN ('Created', 'Pending', 'Succeeded', 'Failed', 'Unknown'))
);

CREATE TABLE processed_event (
	id INTEGER NOT NULL,
	provider VARCHAR(32) NOT NULL,
	provider_event_id VARCHAR(128) NOT NULL,
	callback_log_id BIGINT NOT NULL,
	processed_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_processed_event UNIQUE (provider, provider_event_id)
);

CREATE TABLE outbox (
	id INTEGER NOT NULL,
	event_id VARCHAR(40) NOT NULL,
	event_type VARCHAR(64) NOT NULL,
	aggregate_id VARCHAR(40) NOT NULL,
	payload TEXT NOT NULL,
	status SMALLINT NOT NULL,
	attempts INTEGER NOT NULL,
	next_attempt_at DATETIME NOT NULL,
	last_error VARCHAR(500),
	created_at DATETIME NOT NULL,
	updated_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_outbox_event_id UNIQUE (event_id)
);

CREATE TABLE event_delivery (
	id INTEGER NOT NULL,
	event_id VARCHAR(40) NOT NULL,
	destination VARCHAR(16) NOT NULL,
	status SMALLINT NOT NULL,
	attempts INTEGER NOT NULL,
	next_attempt_at DATETIME NOT NULL,
	last_error VARCHAR(500),
	last_http_status SMALLINT,
	delivered_at DATETIME,
	created_at DATETIME NOT NULL,
	updated_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_event_delivery UNIQUE (event_id, destination),
	CONSTRAINT ck_event_delivery_status CHECK (status IN (0, 1, 2))
);

CREATE TABLE provider_call (
	id INTEGER NOT NULL,
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	provider VARCHAR(32) NOT NULL,
	operation VARCHAR(16) NOT NULL,
	idempotency_key VARCHAR(255),
	request_digest VARCHAR(64) NOT NULL,
	http_status SMALLINT,
	response TEXT,
	error_code VARCHAR(64),
	latency_ms INTEGER,
	outcome VARCHAR(16),
	started_at DATETIME NOT NULL,
	finished_at DATETIME,
	PRIMARY KEY (id)
);

CREATE TABLE provider_breaker (
	provider VARCHAR(32) NOT NULL,
	state VARCHAR(16) NOT NULL,
	consecutive_failures INTEGER NOT NULL,
	open_count INTEGER NOT NULL,
	opened_at DATETIME,
	retry_at DATETIME,
	updated_at DATETIME NOT NULL,
	PRIMARY KEY (provider),
	CONSTRAINT ck_provider_breaker_state CHECK (state IN ('closed', 'open'))
);

CREATE TABLE idempotency_request (
	id INTEGER NOT NULL,
	scope VARCHAR(32) NOT NULL,
	idempotency_key VARCHAR(255) NOT NULL,
	request_digest VARCHAR(64) NOT NULL,
	status VARCHAR(16) NOT NULL,
	response_status SMALLINT,
	response_body TEXT,
	payment_id VARCHAR(40),
	locked_at DATETIME NOT NULL,
	created_at DATETIME NOT NULL,
	updated_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_idempotency_request_key UNIQUE (scope, idempotency_key),
	CONSTRAINT ck_idempotency_request_status CHECK (status IN ('started', 'done'))
);

CREATE TABLE ledger_event (
	id INTEGER NOT NULL,
	event_type VARCHAR(40) NOT NULL,
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	amount_minor BIGINT NOT NULL,
	currency VARCHAR(3) NOT NULL,
	source_type VARCHAR(32) NOT NULL,
	source_id VARCHAR(64),
	dedupe_key VARCHAR(191) NOT NULL,
	details TEXT,
	created_at DATETIME NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_ledger_event_dedupe UNIQUE (dedupe_key)
);

CREATE TABLE ledger_entry (
	id INTEGER NOT NULL,
	ledger_event_id BIGINT NOT NULL,
	account VARCHAR(64) NOT NULL,
	amount_minor BIGINT NOT NULL,
	currency VARCHAR(3) NOT NULL,
	PRIMARY KEY (id)
);

CREATE TABLE manual_review (
	id INTEGER NOT NULL,
	kind VARCHAR(40) NOT NULL,
	payment_id VARCHAR(40),
	refund_id VARCHAR(40),
	callback_log_id BIGINT,
	reason VARCHAR(500) NOT NULL,
	details TEXT,
	status VARCHAR(16) NOT NULL,
	resolution VARCHAR(500),
	resolved_by VARCHAR(64),
	created_at DATETIME NOT NULL,
	resolved_at DATETIME,
	PRIMARY KEY (id)
);

CREATE TABLE alert (
	id INTEGER NOT NULL,
	rule VARCHAR(64) NOT NULL,
	dedupe_key VARCHAR(191) NOT NULL,
	open_key VARCHAR(191),
	severity VARCHAR(16) NOT NULL,
	status VARCHAR(16) NOT NULL,
	message VARCHAR(500) NOT NULL,
	details TEXT,
	first_seen_at DATETIME NOT NULL,
	last_seen_at DATETIME NOT NULL,
	fired_at DATETIME,
	resolved_at DATETIME,
	notified_at DATETIME,
	PRIMARY KEY (id),
	CONSTRAINT uq_alert_open_key UNIQUE (open_key)
);

CREATE INDEX idx_callback_order_no ON payment_callback_log (order_no);

CREATE INDEX idx_callback_create_time ON payment_callback_log (create_time);

CREATE INDEX idx_callback_sweep ON payment_callback_log (status, next_retry_at);

CREATE INDEX idx_callback_event ON payment_callback_log (provider, provider_event_id);

CREATE INDEX idx_payment_status_query ON payment (status, next_query_at);

CREATE INDEX idx_payment_order_no ON payment (order_no);

CREATE INDEX idx_refund_status_query ON refund (status, next_query_at);

CREATE INDEX idx_refund_payment ON refund (payment_id);

CREATE INDEX idx_outbox_aggregate ON outbox (aggregate_id);

CREATE INDEX idx_outbox_due ON outbox (status, next_attempt_at);

CREATE INDEX idx_provider_call_payment ON provider_call (payment_id);

CREATE INDEX idx_provider_call_refund ON provider_call (refund_id);

CREATE INDEX idx_provider_call_started ON provider_call (started_at);

CREATE INDEX idx_ledger_event_payment ON ledger_event (payment_id);

CREATE INDEX idx_ledger_entry_event ON ledger_entry (ledger_event_id);

CREATE INDEX idx_ledger_entry_account ON ledger_entry (account);

CREATE INDEX idx_manual_review_status ON manual_review (status, created_at);

CREATE INDEX idx_manual_review_payment ON manual_review (payment_id);

CREATE INDEX idx_alert_status ON alert (status);

CREATE TRIGGER ledger_event_no_update BEFORE UPDATE ON ledger_event FOR EACH ROW BEGIN SELECT RAISE(ABORT, 'ledger_event is append-only'); END;

CREATE TRIGGER ledger_event_no_delete BEFORE DELETE ON ledger_event FOR EACH ROW BEGIN SELECT RAISE(ABORT, 'ledger_event is append-only'); END;

CREATE TRIGGER ledger_entry_no_update BEFORE UPDATE ON ledger_entry FOR EACH ROW BEGIN SELECT RAISE(ABORT, 'ledger_entry is append-only'); END;

CREATE TRIGGER ledger_entry_no_delete BEFORE DELETE ON ledger_entry FOR EACH ROW BEGIN SELECT RAISE(ABORT, 'ledger_entry is append-only'); END;
