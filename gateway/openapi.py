"""``GET /openapi.json``: the OpenAPI 3.1 description of the merchant API.

Built from the same constants the request parser enforces (providers that are
enabled, currencies, lengths, the largest amount), so the document cannot
drift from what the API accepts; ``tests/test_openapi.py`` checks it against
the app's routes and real answers, and schemathesis fuzzes the API from it.

The test that keeps this document true fails as soon as a merchant route
exists that it does not describe.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from gateway import ext
from payments.outbound.charges import (
    ISO_4217,
    MAX_DESCRIPTION_LENGTH,
    MAX_KEY_LENGTH,
    MAX_ORDER_NO_LENGTH,
    ORDER_NO_VISIBLE,
)
from payments.outbound.refunds import MAX_REASON_LENGTH
from payments.states import PaymentStatus

bp = Blueprint("openapi", __name__)

PAYMENT_STATUSES = [s.value for s in PaymentStatus]

IDEMPOTENCY_KEY_PATTERN = r"^[ -~]*[!-~][ -~]*$"
"""Printable ASCII with at least one non-space character (what a merchant should send)."""


def _error_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _idempotency_key() -> dict[str, Any]:
    return {
        "name": "Idempotency-Key",
        "in": "header",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": IDEMPOTENCY_KEY_PATTERN},
    }


def document(providers: list[str], max_amount: int) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a gateway with these providers enabled and this amount limit."""
    payment_id = {"type": "string", "minLength": 1, "maxLength": 40, "description": "paysync's number (pay_…)"}
    refund_id = {"type": "string", "minLength": 1, "maxLength": 40, "description": "paysync's refund number (re_…)"}
    timestamp = {"type": ["string", "null"], "description": "ISO 8601, UTC"}
    refund = {
        "type": "object",
        "required": ["refund_id", "payment_id", "amount", "currency", "status", "created_at"],
        "properties": {
            "refund_id": refund_id,
            "payment_id": payment_id,
            "amount": {"type": "integer", "description": "minor units"},
            "currency": {"type": "string"},
            "reason": {"type": ["string", "null"]},
            "status": {"type": "string", "enum": PAYMENT_STATUSES},
            "status_source": {"type": ["string", "null"]},
            "provider_refund_id": {"type": ["string", "null"]},
            "error_code": {"type": ["string", "null"]},
            "deadline_at": timestamp,
            "created_at": {"type": "string"},
            "updated_at": timestamp,
        },
    }
    payment = {
        "type": "object",
        "required": ["payment_id", "order_no", "amount", "currency", "provider", "status", "created_at"],
        "properties": {
            "payment_id": payment_id,
            "order_no": {"type": "string"},
            "amount": {"type": "integer", "description": "minor units"},
            "currency": {"type": "string"},
            "provider": {"type": "string"},
            "description": {"type": ["string", "null"]},
            "payment_method": {"type": ["string", "null"]},
            "status": {"type": "string", "enum": PAYMENT_STATUSES},
            "provider_transaction_id": {"type": ["string", "null"]},
            "qr_code": {
                "type": ["string", "null"],
                "description": (
                    "What the payer scans (Alipay `qr_code`, WeChat Pay `code_url`). POST /payments answers with it "
                    "(status Pending) when the provider gave it within CHARGE_INLINE_BUDGET_SECONDS, and leaves it "
                    "out otherwise; GET /payments/{payment_id} shows it once the charge is sent (null before)."
                ),
            },
            "created_at": {"type": "string"},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "paysync merchant API",
            "version": "1",
            "description": (
                "Create payments, refund them, and read their status. Every request needs `Authorization: "
                "Bearer <MERCHANT_API_TOKEN>`. Amounts are integers in minor units. Errors are "
                '`{"error": {"code", "message"}}`.'
            ),
        },
        "security": [{"bearer": []}],
        "paths": {
            "/payments": {
                "post": {
                    "operationId": "createPayment",
                    "summary": "Create a payment (idempotent per Idempotency-Key)",
                    "description": (
                        "The same key with the same body answers the first answer again (header "
                        "`Idempotent-Replayed: true`); the same key with another body is refused with 422; "
                        "a second request with a key while the first is being written waits for it and gets "
                        "its answer; while an Alipay or WeChat Pay first request waits for its QR code, 409. "
                        "Retry a 503 or a lost "
                        "answer with the same key. With Alipay or WeChat Pay the charge is sent at once, and the "
                        "answer is Pending with `qr_code` if the provider gave one within "
                        "CHARGE_INLINE_BUDGET_SECONDS; else Created, and the charge goes on in the background."
                    ),
                    "parameters": [_idempotency_key()],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreatePayment"}}},
                    },
                    "responses": {
                        "201": {
                            "description": "Created, or the first answer replayed",
                            "headers": {
                                "Idempotent-Replayed": {
                                    "description": "true when this is the stored answer of an earlier request",
                                    "schema": {"type": "string", "enum": ["true"]},
                                }
                            },
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Payment"}}},
                            "links": {
                                "GetPayment": {
                                    "operationId": "getPayment",
                                    "parameters": {"payment_id": "$response.body#/payment_id"},
                                },
                                "CreateRefund": {
                                    "operationId": "createRefund",
                                    "parameters": {"payment_id": "$response.body#/payment_id"},
                                },
                            },
                        },
                        "400": _error_response("Malformed request; nothing was written"),
                        "401": _error_response("Missing or wrong bearer token"),
                        "409": _error_response("A request with this Idempotency-Key is still waiting for its QR code"),
                        "413": _error_response("Body too large"),
                        "415": _error_response("Body is not JSON"),
                        "422": _error_response(
                            "This Idempotency-Key was used with a different request (`idempotency_key_reuse`): "
                            "a schema-valid body is refused when its key already names another one"
                        ),
                        "503": _error_response("Storage unavailable; retry with the same key"),
                    },
                }
            },
            "/payments/{payment_id}": {
                "get": {
                    "operationId": "getPayment",
                    "summary": "A payment: status, provider transaction id, ledger, provider calls, callbacks",
                    "parameters": [{"name": "payment_id", "in": "path", "required": True, "schema": payment_id}],
                    "responses": {
                        "200": {
                            "description": "The payment",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PaymentDetail"}}},
                        },
                        "401": _error_response("Missing or wrong bearer token"),
                        "404": _error_response("No such payment"),
                        "503": _error_response("Storage unavailable"),
                    },
                }
            },
            "/payments/{payment_id}/refunds": {
                "post": {
                    "operationId": "createRefund",
                    "summary": "Refund (part of) a Succeeded payment (idempotent per Idempotency-Key)",
                    "description": (
                        "Partial and multiple refunds are allowed; together they never exceed the payment's "
                        "amount minus the refunds already Succeeded or still in flight (a Failed refund frees "
                        "its amount again). Idempotency-Key semantics are those of `POST /payments`. A refused "
                        "request (404, 409 `payment_not_succeeded`, 422 `amount_exceeds_refundable`) writes "
                        "nothing and may be retried with the same key."
                    ),
                    "parameters": [
                        {"name": "payment_id", "in": "path", "required": True, "schema": payment_id},
                        _idempotency_key(),
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreateRefund"}}},
                    },
                    "responses": {
                        "201": {
                            "description": "Created, or the first answer replayed",
                            "headers": {
                                "Idempotent-Replayed": {
                                    "description": "true when this is the stored answer of an earlier request",
                                    "schema": {"type": "string", "enum": ["true"]},
                                }
                            },
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Refund"}}},
                            "links": {
                                "GetRefund": {
                                    "operationId": "getRefund",
                                    "parameters": {
                                        "payment_id": "$response.body#/payment_id",
                                        "refund_id": "$response.body#/refund_id",
                                    },
                                }
                            },
                        },
                        "400": _error_response("Malformed request; nothing was written"),
                        "401": _error_response("Missing or wrong bearer token"),
                        "404": _error_response("No such payment"),
                        "409": _error_response(
                            "The payment is not Succeeded (`payment_not_succeeded`), or a request with this "
                            "Idempotency-Key is still in flight (`request_in_progress`)"
                        ),
                        "413": _error_response("Body too large"),
                        "415": _error_response("Body is not JSON"),
                        "422": _error_response(
                            "More than is left to refund (`amount_exceeds_refundable`), or this Idempotency-Key "
                            "was used with a different request (`idempotency_key_reuse`)"
                        ),
                        "503": _error_response("Storage unavailable; retry with the same key"),
                    },
                }
            },
            "/payments/{payment_id}/refunds/{refund_id}": {
                "get": {
                    "operationId": "getRefund",
                    "summary": "One refund of a payment: status, provider refund id, ledger, provider calls",
                    "parameters": [
                        {"name": "payment_id", "in": "path", "required": True, "schema": payment_id},
                        {"name": "refund_id", "in": "path", "required": True, "schema": refund_id},
                    ],
                    "responses": {
                        "200": {
                            "description": "The refund",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RefundDetail"}}},
                        },
                        "401": _error_response("Missing or wrong bearer token"),
                        "404": _error_response("No such refund of this payment"),
                        "503": _error_response("Storage unavailable"),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "CreatePayment": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["order_no", "amount", "currency", "provider"],
                    "properties": {
                        "order_no": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_ORDER_NO_LENGTH,
                            "pattern": ORDER_NO_VISIBLE,
                            "description": "the merchant's order number",
                        },
                        "amount": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": max_amount,
                            "description": (
                                "minor units (fen, cents): an integer, taken exactly however JSON writes it "
                                "(1000, 1000.0 and 1e3 are the same amount); a fraction (10.5) is refused with 400"
                            ),
                        },
                        "currency": {"type": "string", "enum": sorted(ISO_4217)},
                        "provider": {"type": "string", "enum": sorted(providers)},
                        "description": {"type": ["string", "null"], "maxLength": MAX_DESCRIPTION_LENGTH},
                    },
                },
                "CreateRefund": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["amount"],
                    "properties": {
                        "amount": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": 2**63 - 1,
                            "description": (
                                "minor units, an integer as for a payment (1000.0 is 1000); at most what is left "
                                "to refund (else 422 `amount_exceeds_refundable`)"
                            ),
                        },
                        "reason": {"type": ["string", "null"], "maxLength": MAX_REASON_LENGTH},
                    },
                },
                "Refund": refund,
                "RefundDetail": {
                    "allOf": [{"$ref": "#/components/schemas/Refund"}],
                    "type": "object",
                    "required": ["ledger", "provider_calls"],
                    "properties": {
                        "next_query_at": timestamp,
                        "query_attempts": {"type": ["integer", "null"]},
                        "ledger": {"type": "array", "items": {"type": "object"}},
                        "provider_calls": {"type": "array", "items": {"type": "object"}},
                    },
                },
                "Payment": payment,
                "PaymentDetail": {
                    "allOf": [{"$ref": "#/components/schemas/Payment"}],
                    "type": "object",
                    "required": ["updated_at", "ledger", "refunds", "provider_calls", "callbacks"],
                    "properties": {
                        "status_source": {"type": ["string", "null"]},
                        "error_code": {"type": ["string", "null"]},
                        "next_query_at": timestamp,
                        "query_attempts": {"type": ["integer", "null"]},
                        "deadline_at": timestamp,
                        "updated_at": timestamp,
                        "ledger": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["event_type", "amount", "currency", "entries"],
                                "properties": {
                                    "event_type": {"type": "string"},
                                    "amount": {"type": "integer"},
                                    "currency": {"type": "string"},
                                    "entries": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["account", "amount"],
                                            "properties": {
                                                "account": {"type": "string"},
                                                "amount": {"type": "integer"},
                                            },
                                        },
                                    },
                                },
                            },
                        },
                        "refunds": {"type": "array", "items": {"$ref": "#/components/schemas/Refund"}},
                        "amount_refunded": {"type": "integer", "description": "refunds Succeeded"},
                        "amount_refundable": {
                            "type": "integer",
                            "description": "what a refund may still take (0 unless Succeeded)",
                        },
                        "provider_calls": {"type": "array", "items": {"type": "object"}},
                        "callbacks": {
                            "type": "array",
                            "items": {"type": "object"},
                            "description": "the newest 50 deliveries verified as this payment's callbacks",
                        },
                        "callbacks_total": {"type": "integer", "description": "all verified ones"},
                        "rejected_callbacks": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "source": {"type": "string"},
                                    "reason": {"type": "string"},
                                    "received_at": timestamp,
                                },
                            },
                            "description": "the newest 50 deliveries naming this payment that did not verify",
                        },
                        "rejected_callbacks_total": {"type": "integer", "description": "all that did not verify"},
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                        }
                    },
                },
            },
        },
    }


@bp.get("/openapi.json")
def openapi() -> Any:
    """The document for this gateway's configuration (no token needed: it holds no secret)."""
    return jsonify(document(list(ext("providers")), ext("settings").merchant_max_amount))
