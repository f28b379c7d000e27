"""Amounts between paysync's minor units and Stripe's ``amount`` integers (pure).

paysync keeps money as integer minor units of the ISO 4217 currency (JPY 500
is 500, USD 10.00 is 1000, KWD 1.250 is 1250). Stripe's API also takes "the
currency's smallest unit", with its own list of exponents
(https://docs.stripe.com/currencies, "Zero-decimal currencies", "Three-decimal
currencies", "Special cases"). The two agree for almost every currency; where
they do not, the conversion here is the one place that knows:

- zero-decimal at Stripe: BIF CLP DJF GNF JPY KMF KRW MGA PYG RWF UGX VND VUV
  XAF XOF XPF. ISO gives MGA two decimals, so MGA minor units are divided by
  100 (and must be whole ariary).
- ISK is zero-decimal in ISO but Stripe keeps it two-decimal with amounts that
  must be divisible by 100: ISK 5 is Stripe ``500``.
- three-decimal at Stripe: BHD JOD KWD OMR TND, and the last digit must be 0
  (Stripe rounds to the nearest ten for its partners): KWD 5.124 is refused.
- HUF and TWD are two-decimal in both (only payouts are whole units at Stripe).
Anything that cannot be represented exactly is refused (``AmountError``),
never rounded: a rounded charge is a different charge.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

STRIPE_ZERO_DECIMAL = frozenset("BIF CLP DJF GNF JPY KMF KRW MGA PYG RWF UGX VND VUV XAF XOF XPF".split())
"""Stripe's zero-decimal currencies: ``amount`` counts whole units."""
STRIPE_THREE_DECIMAL = frozenset("BHD JOD KWD OMR TND".split())
"""Stripe's three-decimal currencies: ``amount`` counts thousandths, and must be a multiple of 10."""
STRIPE_WHOLE_UNITS_ONLY = frozenset({"ISK"})
"""Two-decimal at Stripe, but only whole units may be charged: ``amount`` must be a multiple of 100."""

ISO_ZERO_DECIMAL = frozenset("BIF CLP DJF GNF ISK JPY KMF KRW PYG RWF UGX UYI VND VUV XAF XOF XPF".split())
"""ISO 4217 currencies with no minor unit."""
ISO_THREE_DECIMAL = frozenset("BHD IQD JOD KWD LYD OMR TND".split())
"""ISO 4217 currencies with three decimals."""

_CODE = re.compile(r"[A-Za-z]{3}", re.ASCII)


class AmountError(ValueError):
    """An amount or currency that cannot be said exactly on the other side."""


def iso_exponent(currency: str) -> int:
    """Decimals of the ISO 4217 minor unit (paysync's ``amount_minor``)."""
    code = _code(currency)
    if code in ISO_ZERO_DECIMAL:
        return 0
    if code in ISO_THREE_DECIMAL:
        return 3
    return 2


def stripe_exponent(currency: str) -> int:
    """Decimals of Stripe's ``amount`` for ``currency``."""
    code = _code(currency)
    if code in STRIPE_ZERO_DECIMAL:
        return 0
    if code in STRIPE_THREE_DECIMAL:
        return 3
    if code in ISO_THREE_DECIMAL:
        # ISO says three decimals, Stripe lists it with neither: we cannot know what it would read.
        raise AmountError(f"{code} is three-decimal in ISO 4217 but not in Stripe's three-decimal list")
    return 2


def to_stripe(amount_minor: int, currency: str) -> int:
    """paysync minor units → Stripe ``amount``; AmountError if Stripe cannot take exactly this amount."""
    if isinstance(amount_minor, bool) or not isinstance(amount_minor, int):
        raise AmountError("amount must be an integer number of minor units")
    code = _code(currency)
    shift = stripe_exponent(code) - iso_exponent(code)
    if shift >= 0:
        amount = amount_minor * 10**shift
    else:
        amount, rest = divmod(amount_minor, 10**-shift)
        if rest:
            raise AmountError(f"{code} {amount_minor} minor units is not a whole amount at Stripe")
    if code in STRIPE_THREE_DECIMAL and amount % 10:
        raise AmountError(f"{code} amounts at Stripe must end in 0 (got {amount})")
    if code in STRIPE_WHOLE_UNITS_ONLY and amount % 100:
        raise AmountError(f"{code} amounts at Stripe must be whole units (got {amount})")
    return amount


def from_stripe(amount: int, currency: str) -> int:
    """Stripe ``amount`` → paysync minor units; AmountError if it is not a whole number of them."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise AmountError("Stripe amount must be an integer")
    code = _code(currency)
    shift = iso_exponent(code) - stripe_exponent(code)
    if shift >= 0:
        return amount * 10**shift
    minor, rest = divmod(amount, 10**-shift)
    if rest:
        raise AmountError(f"Stripe {code} amount {amount} is not a whole number of ISO minor units")
    return minor


def major_to_minor(value: str | Decimal, currency: str) -> int:
    """A decimal amount in major units (``"10.50"``) → ISO minor units, exactly; AmountError otherwise."""
    try:
        number = Decimal(value)
    except (InvalidOperation, TypeError, ValueError):
        raise AmountError(f"{str(value)[:40]!r} is not a decimal amount") from None
    if not number.is_finite():
        raise AmountError("amount must be finite")
    scaled = number.scaleb(iso_exponent(currency))
    if scaled != scaled.to_integral_value():
        raise AmountError(f"{value} has more decimals than {_code(currency)} allows")
    return int(scaled)


def stripe_currency(currency: str) -> str:
    """The lower-case code Stripe expects in requests."""
    return _code(currency).lower()


def iso_currency(value: object) -> str:
    """A Stripe currency code (lower case) as paysync writes it (upper case); AmountError if it is not one."""
    if not isinstance(value, str) or not _CODE.fullmatch(value):
        raise AmountError("currency must be a three-letter code")
    return value.upper()


def _code(currency: str) -> str:
    if not isinstance(currency, str) or not _CODE.fullmatch(currency):
        raise AmountError("currency must be a three-letter ISO 4217 code")
    return currency.upper()
