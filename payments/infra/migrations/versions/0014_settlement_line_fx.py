"""settlement_line: the settlement side of cross-currency lines (amount, currency, exchange rate).

A Stripe balance transaction of a charge in EUR settled in USD is matched on the
charge's amount and currency; what reached the balance, in which currency and at
which rate, is kept beside it (issue 21, item 9).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("settlement_line", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "settlement_amount_minor",
                sa.BigInteger(),
                nullable=True,
                comment="cross-currency lines: the magnitude that reached our balance (and fee_minor's currency)",
            )
        )
        batch_op.add_column(
            sa.Column(
                "settlement_currency",
                sa.String(length=3),
                nullable=True,
                comment="cross-currency lines: the balance's currency (amount_minor and currency are the charge's)",
            )
        )
        batch_op.add_column(
            sa.Column(
                "exchange_rate",
                sa.String(length=32),
                nullable=True,
                comment="cross-currency lines: the provider's rate, as written (amount x rate = settlement amount)",
            )
        )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
