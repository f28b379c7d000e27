"""Aliyun SMS (dysmsapi ``SendSms``), signed with the RPC signature (SignatureVersion 1.0, HMAC-SHA1).

From Aliyun's SMS API docs ("common parameters", "signature method", SendSms):

- parameters: the common ones (``AccessKeyId``, ``Action=SendSms``,
  ``Format=JSON``, ``RegionId=cn-hangzhou``, ``SignatureMethod=HMAC-SHA1``,
  ``SignatureNonce`` unique per request, ``SignatureVersion=1.0``,
  ``Timestamp`` UTC ``yyyy-MM-ddTHH:mm:ssZ``, ``Version=2017-05-25``) and
  SendSms's own (``PhoneNumbers`` comma-separated, ``SignName``,
  ``TemplateCode``, ``TemplateParam`` a JSON object for the template's
  ``${variables}``, ``OutId`` our id for the send);
- canonical query: every parameter but ``Signature``, sorted by name, name and
  value each percent-encoded (RFC 3986: A-Z a-z 0-9 ``-_.~`` as they are,
  everything else as ``%XY`` of its UTF-8 bytes, space as ``%20``), joined
  ``name=value`` with ``&``;
- ``StringToSign = HTTPMethod + "&" + percentEncode("/") + "&" + percentEncode(canonical query)``;
- ``Signature = base64(HMAC-SHA1(key = AccessKeySecret + "&", StringToSign))``.

We POST the parameters as a form body (the signature covers the method, so
the StringToSign starts ``POST&``): the key id and signature stay out of URLs
and access logs. The answer's ``Code`` is ``OK`` on success; throttling
(``isv.BUSINESS_LIMIT_CONTROL``, ``Throttling…``) and ``isp.`` server errors
are retried, every other code (bad key, signature, template, number) is
permanent until someone fixes the configuration.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from payments.errors import NotificationFailed
from payments.escalation.notify import Notice, template
from payments.escalation.notify.http import HttpAnswer, HttpRequest, retry_after, service_text
from payments.escalation.notify.sms_http import values

NAME = "aliyun_sms"
API_VERSION = "2017-05-25"
REGION = "cn-hangzhou"
ALLOWED = template.NOTICE_FIELDS
TRANSIENT_PREFIXES = ("isv.BUSINESS_LIMIT_CONTROL", "Throttling", "isp.", "ServiceUnavailable", "InternalError")


def percent_encode(value: str) -> str:
    """RFC 3986 percent-encoding as the RPC signature defines it (``~`` kept, space as %20, ``*`` as %2A)."""
    return quote(value.encode("utf-8"), safe="-_.~")


def canonical_query(params: Mapping[str, str]) -> str:
    """The sorted, encoded ``name=value&…`` string the signature covers (``Signature`` itself left out)."""
    return "&".join(f"{percent_encode(k)}={percent_encode(v)}" for k, v in sorted(params.items()) if k != "Signature")


def string_to_sign(method: str, params: Mapping[str, str]) -> str:
    """``METHOD&%2F&<encoded canonical query>``."""
    return f"{method}&{percent_encode('/')}&{percent_encode(canonical_query(params))}"


def signature(access_key_secret: str, method: str, params: Mapping[str, str]) -> str:
    """base64(HMAC-SHA1(secret + "&", StringToSign))."""
    key = (access_key_secret + "&").encode("utf-8")
    digest = hmac.new(key, string_to_sign(method, params).encode("utf-8"), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def timestamp(now: datetime) -> str:
    """``now`` (naive UTC or aware) in the format the API asks for."""
    if now.tzinfo is not None:
        now = now.astimezone(UTC).replace(tzinfo=None)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def params(
    access_key_id: str,
    sign_name: str,
    template_code: str,
    param_template: Any,
    phones: Sequence[str],
    notice: Notice,
    now: datetime,
    nonce: str,
) -> dict[str, str]:
    """Every parameter of one SendSms call except ``Signature``."""
    template_param = template.render(param_template, values(notice))
    return {
        "AccessKeyId": access_key_id,
        "Action": "SendSms",
        "Format": "JSON",
        "OutId": notice.message_id,
        "PhoneNumbers": ",".join(phones),
        "RegionId": REGION,
        "SignName": sign_name,
        "SignatureMethod": "HMAC-SHA1",
        "SignatureNonce": nonce,
        "SignatureVersion": "1.0",
        "TemplateCode": template_code,
        "TemplateParam": json.dumps(template_param, ensure_ascii=False, separators=(",", ":")),
        "Timestamp": timestamp(now),
        "Version": API_VERSION,
    }


def build(
    endpoint: str,
    access_key_id: str,
    access_key_secret: str,
    sign_name: str,
    template_code: str,
    param_template: Any,
    phones: Sequence[str],
    notice: Notice,
    now: datetime | None = None,
    nonce: str | None = None,
) -> HttpRequest:
    """The signed POST for ``notice``."""
    p = params(
        access_key_id,
        sign_name,
        template_code,
        param_template,
        phones,
        notice,
        now or datetime.now(UTC),
        nonce or str(uuid.uuid4()),
    )
    body = f"{canonical_query(p)}&Signature={percent_encode(signature(access_key_secret, 'POST', p))}"
    return HttpRequest(
        url=endpoint.rstrip("/") + "/",
        body=body.encode("ascii"),
        headers={"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"},
    )


def check(answer: HttpAnswer) -> str:
    """Raise NotificationFailed unless the answer's Code is OK (the JSON is read whatever the HTTP status)."""
    data = answer.json()
    code = data.get("Code") if isinstance(data, dict) else None
    if code == "OK" and 200 <= answer.status < 300:
        return f"accepted (BizId {service_text(data.get('BizId', ''), 64)})"
    if code is None:
        raise NotificationFailed(
            f"{NAME} answered HTTP {answer.status} without a Code",
            permanent=400 <= answer.status < 500 and answer.status not in (408, 429),
            retry_after=retry_after(answer),
        )
    transient = answer.status >= 500 or str(code).startswith(TRANSIENT_PREFIXES)
    raise NotificationFailed(
        f"{NAME} {service_text(code, 80)}: {service_text(data.get('Message', ''))}", permanent=not transient
    )
