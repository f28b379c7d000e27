"""Arrange ``payments/`` in wings by capability (issue 22, item 1): move the modules, rewrite every reference.

    python tools/wings.py            move the files (git mv), create the wing packages, rewrite references
    python tools/wings.py --check    print what would move and which files would change; touch nothing

then ``ruff check --fix . && ruff format .`` (import order and line wrapping of rewritten imports).

Re-runnable: ``MOVES`` says where each old module goes, so the same run applies on top of a tree that other
branches changed in the old flat layout. Running it twice changes nothing: a name that is already new is left
alone. A module the table does not know stays where it is and is printed as ``unplaced: payments/foo.py``; add
it to ``MOVES`` (or to ``STAYS``) and run again.

References rewritten in every tracked text file: ``import payments.x``, ``from payments import x``,
``from payments.x import y``, dotted strings (``"payments.relay.time.monotonic"`` mock targets, logger names,
docs) and paths (``payments/relay.py``, ``payments/migrations/versions``). Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MOVES: dict[str, str] = {
    # infra: what any capability stands on; no domain decisions.
    "payments.db": "payments.infra.db",
    "payments.schema": "payments.infra.schema",
    "payments.settings": "payments.infra.settings",
    "payments.migrations": "payments.infra.migrations",  # a package: moved whole, versions/ included
    "payments.logs": "payments.infra.logs",
    "payments.metrics": "payments.infra.metrics",
    "payments.locks": "payments.infra.locks",
    "payments.group_commit": "payments.infra.group_commit",
    "payments.ids": "payments.infra.ids",
    "payments.backoff": "payments.infra.backoff",
    "payments.sources": "payments.infra.sources",
    "payments.webhook_signing": "payments.infra.webhook_signing",
    "payments.ratelimit": "payments.infra.ratelimit",
    "payments.failpoints": "payments.infra.failpoints",
    "payments.cursors": "payments.infra.cursors",
    # Retention archives and deletes settled callback rows by age; the alert evaluators use its clause of
    # refused rows, so it sits below escalation rather than in inbound.
    "payments.retention": "payments.infra.retention",
    # providers: one folder per provider (adapter, signing, money, bill parser); the bill interface beside base.
    "payments.settlement": "payments.providers.settlement",
    "payments.providers.sandbox": "payments.providers.sandbox.adapter",
    "payments.bills.sandbox": "payments.providers.sandbox.bill",
    "payments.providers.alipay": "payments.providers.alipay.adapter",
    "payments.providers.alipay_sign": "payments.providers.alipay.sign",
    "payments.bills.alipay": "payments.providers.alipay.bill",
    "payments.providers.wechatpay": "payments.providers.wechatpay.adapter",
    "payments.providers.wechatpay_sign": "payments.providers.wechatpay.sign",
    "payments.bills.wechatpay": "payments.providers.wechatpay.bill",
    "payments.providers.stripe": "payments.providers.stripe.adapter",
    "payments.providers.stripe_sign": "payments.providers.stripe.sign",
    "payments.providers.stripe_money": "payments.providers.stripe.money",
    "payments.bills.stripe": "payments.providers.stripe.bill",
    # money: the ledger.
    "payments.ledger": "payments.money.ledger",
    # escalation: what a person is told and asked.
    "payments.alerts": "payments.escalation.alerts",
    "payments.review": "payments.escalation.review",
    "payments.alert_rules": "payments.escalation.rules",
    "payments.alert_evaluators": "payments.escalation.evaluators",
    "payments.notifications": "payments.escalation.notifications",
    "payments.notify": "payments.escalation.notify",  # a package: moved whole
    # lifecycle: how a payment's state changes and who hears of it.
    "payments.transitions": "payments.lifecycle.transitions",
    "payments.outbox": "payments.lifecycle.outbox",
    "payments.events": "payments.lifecycle.events",
    # inbound: notifications from the providers.
    "payments.callbacks": "payments.inbound.callbacks",
    "payments.delivery": "payments.inbound.delivery",
    "payments.hints": "payments.inbound.hints",
    # outbound: our calls to the providers (charges.create verifies a synchronous answer as inbound does).
    "payments.charges": "payments.outbound.charges",
    "payments.refunds": "payments.outbound.refunds",
    "payments.relay_batch": "payments.outbound.relay_batch",
    "payments.provider_calls": "payments.outbound.provider_calls",
    "payments.breaker": "payments.outbound.breaker",
    "payments.idempotency": "payments.outbound.idempotency",
    # reconciliation: settlement files against our records.
    "payments.reconcile": "payments.reconciliation.reconcile",
    "payments.aging": "payments.reconciliation.aging",
    # ops: what the console and the operators read and do.
    "payments.outbound_protocol": "payments.outbound.protocol",
    "payments.send_pool": "payments.outbound.send_pool",
    "payments.query_schedule": "payments.outbound.query_schedule",
    "payments.callback_intake": "payments.inbound.intake",
    "payments.callback_processing": "payments.inbound.processing",
    "payments.callback_reverify": "payments.inbound.reverify",
    "payments.event_catch_up": "payments.inbound.catch_up",
    "payments.alert_actions": "payments.ops.alert_actions",
    "payments.settings_reference": "payments.infra.settings_reference",
    "payments.ops_actions": "payments.ops.actions",
    "payments.ops_sessions": "payments.ops.sessions",
    "payments.monitoring": "payments.ops.monitoring",
}
"""Old module (or package) -> new one. A package is moved whole, with every file in it."""

STAYS = {"payments", "payments.__main__", "payments.errors", "payments.states", "payments.runtime"}
"""Modules that stay at the top of payments/: the kernel (errors, states) and the entry points above every wing."""

DISSOLVED = ("payments/bills",)
"""Packages emptied by the moves: their ``__init__.py`` goes once no other module is left in them."""

WINGS: dict[str, str] = {
    "payments/infra": """What every capability stands on and that decides nothing about money: the database (engine,
schema, migrations, group commit, locks, cursors), settings (parsing values only), logs, metrics, ids,
back-off, rate limiting, network source checks, webhook signing, failpoints and callback-row retention.
It may import the kernel (``payments.errors``, ``payments.states``) and nothing else of payments.""",
    "payments/providers": None,  # exists: its own docstring says what it owns (the registry of adapters)
    "payments/providers/sandbox": """The sandbox platform: its adapter and its settlement-file parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.""",
    "payments/providers/alipay": """Alipay: its adapter, RSA2 signing and certificate mode, and its bill parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.""",
    "payments/providers/wechatpay": """WeChat Pay v3: its adapter, signing and platform keys, and its bill parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.""",
    "payments/providers/stripe": """Stripe: its adapter, webhook signatures, minor-unit money and its balance-report
parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.""",
    "payments/money": """The ledger: append-only entries for every movement of money, and their sealing.
It may import the kernel and ``payments.infra``.""",
    "payments/escalation": """What a person is told and asked: alerts, the alert rules file and its evaluators,
notifications and their channels (``notify/``), and the manual-review queue. It may import the kernel and
``payments.infra``; every other wing may raise an alert or open a review through it.""",
    "payments/lifecycle": """How a payment's or refund's state changes, and who hears of it: the guarded transitions,
the outbox of calls to make, and the merchant's events. It may import the kernel, ``payments.infra``,
``payments.providers``, ``payments.money`` and ``payments.escalation``.""",
    "payments/inbound": """Notifications from the providers: store, verify, apply (callbacks), the signed message that
carries one through the broker and the batch that applies many (delivery), and unverified hints.
It may import every wing below it: the kernel, infra, providers, money, escalation and lifecycle.""",
    "payments/reconciliation": """Settlement files against our records: import, match, explain, and the ageing report.
It may import the kernel, infra, providers, money, escalation and lifecycle.""",
    "payments/outbound": """Our calls to the providers: charges and refunds created, relayed from the outbox (one at a
time or in batches), queried when unresolved, recorded as provider calls, behind a circuit breaker and the
merchant's idempotency keys. It may import every wing below it, inbound included (a synchronous answer is
verified as a notification is).""",
    "payments/ops": """What operators read and do: the console's actions and sessions, and the counts /metrics shows.
It sits on top and may import every other wing.""",
}
"""New packages and the first paragraph of their ``__init__``: what the wing owns and what it may import."""

SUFFIXES = {
    ".py",
    ".md",
    ".toml",
    ".yml",
    ".yaml",
    ".txt",
    ".cfg",
    ".ini",
    ".sh",
    ".json",
    ".html",
    ".lua",
    ".sql",
    ".css",
}
NAMES = {"Makefile", "Procfile", "run", ".gitignore"}
SKIP = ("bench/results/", "tools/wings.py")
"""Not rewritten: measurements, and this table (its old names are the point)."""
HISTORY = re.compile(r"payments/(infra/)?migrations/versions/")
"""Migration revisions are history: moved with their package, their text left as it was written."""

DOTTED = re.compile(r"(?<![\w.])payments(?:\.\w+)+")
PATH = re.compile(r"(?<![\w.-])payments((?:/\w+)+)(\.py)?")


def git(*args: str, check: bool = True) -> str:
    """Run git in the repository; its stdout."""
    # git from PATH with our own arguments: a developer's tool run in their checkout.
    return subprocess.run(["git", *args], cwd=ROOT, check=check, capture_output=True, text=True).stdout  # noqa: S603, S607


def path_of(module: str) -> Path:
    """payments.a.b -> payments/a/b (no suffix)."""
    return Path(*module.split("."))


PACKAGES = {"payments.migrations", "payments.notify"}
"""The entries of MOVES that are packages."""


def new_names() -> set[str]:
    """Every module and package name of the new layout: the table's targets, their parents, and what is on disk."""
    names = set(STAYS)
    for target in list(MOVES.values()) + [w.replace("/", ".") for w in WINGS]:
        parts = target.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for path in (ROOT / "payments").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        names.add(module.removesuffix(".__init__"))
    return {n for n in names if not is_old_only(n)}


def is_old_only(name: str) -> bool:
    """An old module (or one inside an old package) that is not also a package of the new layout.

    ``payments.relay`` and ``payments.notify.slack`` are old only; ``payments.providers.stripe`` is old (the
    adapter) and new (the provider's folder) at once.
    """
    old = name in MOVES or any(name.startswith(p + ".") for p in PACKAGES)
    return old and not any(t.startswith(name + ".") for t in MOVES.values())


def resolve(dotted: str, new: set[str]) -> str:
    """The new spelling of a dotted name (module, module.attribute...); unchanged if it is new already or not ours."""
    parts = dotted.split(".")
    newest = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in new), default=0)
    oldest = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MOVES), default=0)
    if oldest == 0 or newest > oldest:
        return dotted
    return ".".join([MOVES[".".join(parts[:oldest])], *parts[oldest:]])


def resolve_path(match: re.Match[str], new: set[str]) -> str:
    """The new spelling of payments/a/b(.py): a module's file needs its .py; a package's path may go on."""
    parts = ["payments", *match.group(1).strip("/").split("/")]
    dotted = ".".join(parts)
    oldest = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MOVES), default=0)
    if oldest == 0:
        return match.group(0)
    if ".".join(parts[:oldest]) not in PACKAGES and not (match.group(2) and oldest == len(parts)):
        return match.group(0)
    moved = resolve(dotted, new)
    return moved.replace(".", "/") + (match.group(2) or "")


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """Character offset of (line, byte column) as ast reports them."""
    before = sum(len(line) for line in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))


def _rewrite_from(node: ast.ImportFrom, text: str, new: set[str]) -> str:
    """One ``from payments... import ...`` statement in the new layout (the same text when nothing moves)."""
    module = node.module or ""
    groups: dict[str, list[str]] = {}
    modules_moved = False
    for alias in node.names:
        bound = alias.asname or alias.name
        full = f"{module}.{alias.name}"
        # A module imported from its package; an old module name that is also a new package
        # (payments.providers.stripe) still means the old module here: nobody imports a provider's bare folder.
        if alias.name != "*" and full in _modules_of_old() and (full in MOVES or full not in new):
            modules_moved = True
            target = resolve(full, new)
            parent, leaf = target.rsplit(".", 1)
            groups.setdefault(parent, []).append(leaf if leaf == bound else f"{leaf} as {bound}")
        else:
            source = module if full in new else resolve(module, new)
            groups.setdefault(source, []).append(alias.name if alias.asname is None else f"{alias.name} as {bound}")
    if list(groups) == [module]:
        return text
    if len(groups) == 1 and "#" in text and not modules_moved:  # keep comments: only the module name changes
        return text.replace(module, next(iter(groups)), 1)
    indent = " " * node.col_offset
    lines = [f"from {source} import {', '.join(names)}" for source, names in groups.items()]
    return ("\n" + indent).join(lines)


_OLD_MODULES: set[str] | None = None


def _modules_of_old() -> set[str]:
    """Old module names, the modules inside old packages included (payments.notify.slack)."""
    global _OLD_MODULES
    if _OLD_MODULES is None:
        _OLD_MODULES = set(MOVES)
        for old, target in MOVES.items():
            if old in PACKAGES:
                for base in (path_of(old), path_of(target)):
                    for path in (ROOT / base).rglob("*.py") if (ROOT / base).is_dir() else ():
                        rel = path.relative_to(ROOT / base).with_suffix("")
                        _OLD_MODULES.add(".".join([old, *rel.parts]).removesuffix(".__init__"))
    return _OLD_MODULES


def _rewrite_import(node: ast.Import, text: str, new: set[str]) -> str:
    for alias in node.names:
        moved = resolve(alias.name, new)
        if moved != alias.name:
            text = re.sub(rf"(?<![\w.]){re.escape(alias.name)}(?![\w.])", moved, text, count=1)
    return text


SQL_COMMENT = re.compile(r"COMMENT\s*=?\s*'(?:[^']|'')*'")


def rewrite_text(text: str, new: set[str], *, sql: bool = False) -> str:
    """Every dotted name and path of ours in a text in the new layout (in SQL, COMMENT '...' values stay)."""
    if sql:
        pieces = SQL_COMMENT.split(text)
        kept = SQL_COMMENT.findall(text)
        return "".join(rewrite_text(p, new) + (kept[i] if i < len(kept) else "") for i, p in enumerate(pieces))
    text = PATH.sub(lambda m: resolve_path(m, new), text)
    return DOTTED.sub(lambda m: resolve(m.group(0), new), text)


def rewrite_python(source: str, new: set[str]) -> str:
    """A Python file: its import statements rewritten one by one, everything else as text."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return rewrite_text(source, new)
    lines = source.splitlines(keepends=True)
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "payments":
            pass
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "payments" for a in node.names):
            pass
        elif isinstance(node, ast.keyword) and node.arg == "comment":
            node = node.value  # a database comment is data: the deployed schema holds it as written
        else:
            continue
        start = _offset(lines, node.lineno, node.col_offset)
        end = _offset(lines, node.end_lineno or node.lineno, node.end_col_offset or 0)
        spans.append((start, end, node))
    out, at = [], 0
    for start, end, node in sorted(spans, key=lambda s: s[0]):
        out.append(rewrite_text(source[at:start], new))
        piece = source[start:end]
        if isinstance(node, ast.ImportFrom):
            out.append(_rewrite_from(node, piece, new))
        elif isinstance(node, ast.Import):
            out.append(_rewrite_import(node, piece, new))
        else:
            out.append(piece)
        at = end
    out.append(rewrite_text(source[at:], new))
    return "".join(out)


LINE_LENGTH = 120
"""pyproject's ruff line-length: a docstring or comment line the longer names push past it is wrapped."""

QUOTES = ('"' * 3, "'" * 3)


def wrap_long_lines(source: str) -> str:
    """Wrap docstring and whole-line comment lines longer than LINE_LENGTH at a space; code is left alone.

    Docstrings only (a string statement), never other strings: their text is data and a wrap would change it.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    docstring_lines: dict[int, int] = {}  # line number -> column of the docstring's first quote
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for lineno in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                docstring_lines[lineno] = node.col_offset
    out = []
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
        body = line.rstrip("\r\n")
        end = line[len(body) :]
        comment = re.match(r"(\s*# )", body)
        if len(body) <= LINE_LENGTH or "noqa" in body or "://" in body or not (comment or lineno in docstring_lines):
            out.append(line)
            continue
        if comment:
            prefix = comment.group(1)
        elif body.lstrip().startswith(QUOTES):
            prefix = " " * docstring_lines[lineno]
        else:
            prefix = body[: len(body) - len(body.lstrip())]
        pieces = []
        while len(body) > LINE_LENGTH:
            cut = body.rfind(" ", len(prefix) + 20, LINE_LENGTH + 1)
            if cut < 0:
                break
            pieces.append(body[:cut].rstrip())
            body = prefix + body[cut + 1 :]
        pieces.append(body)
        out.append("\n".join(pieces) + end)
    return "".join(out)


def tracked() -> list[Path]:
    """The repository's tracked text files that may name a module of ours."""
    files = []
    for name in git("ls-files").splitlines():
        path = ROOT / name
        if name.startswith(SKIP) or HISTORY.match(name) or not path.is_file():
            continue
        if path.suffix in SUFFIXES or path.name in NAMES:
            files.append(path)
    return files


def planned_moves() -> list[tuple[Path, Path, int, int]]:
    """(old file, new file, inside, deeper) for every tracked file the table moves that is still in its old place.

    ``inside``: how many ``.parent`` steps from the file stay inside what moves with it (0 for a lone module,
    its depth in the package for a package's file); ``deeper``: how many folders deeper it lands.
    """
    moves = []
    for old, target in MOVES.items():
        deeper = len(target.split(".")) - len(old.split("."))
        if old in PACKAGES:
            base = ROOT / path_of(old)
            for name in git("ls-files", str(path_of(old))).splitlines() if base.is_dir() else ():
                rel = (ROOT / name).relative_to(base)
                moves.append((ROOT / name, ROOT / path_of(target) / rel, len(rel.parts), deeper))
        else:
            src = (ROOT / path_of(old)).with_suffix(".py")
            if src.is_file() and git("ls-files", str(src.relative_to(ROOT))).strip():
                moves.append((src, (ROOT / path_of(target)).with_suffix(".py"), 0, deeper))
    return moves


FILE_CLIMB = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?)((?:\.parent)+)")


def keep_file_paths(path: Path, inside: int, deeper: int) -> None:
    """A moved file's ``Path(__file__)...parent`` chains that leave what moved with it climb ``deeper`` more.

    Done once, when the file moves (so a second run adds nothing): ``DEFAULT_RULES_FILE`` must still find
    ``ops/alert_rules.toml`` at the repository's top.
    """
    if path.suffix != ".py" or deeper == 0:
        return
    text = path.read_text(encoding="utf-8")

    def climb(match: re.Match[str]) -> str:
        steps = match.group(2).count(".parent")
        return match.group(0) if steps <= inside else match.group(1) + ".parent" * (steps + deeper)

    fixed = FILE_CLIMB.sub(climb, text)
    if fixed != text:
        print(f"climb: {path.relative_to(ROOT)}: Path(__file__) climbs {deeper} more folder(s)")
        path.write_text(fixed, encoding="utf-8")


def unplaced() -> list[str]:
    """Modules in the old flat places (payments/, payments/providers/, payments/bills/) the table does not place."""
    known = set(STAYS) | set(MOVES) | set(MOVES.values()) | {"payments.providers", "payments.providers.base"}
    known.add("payments.bills")
    found = []
    for folder in ("payments", "payments/providers", "payments/bills"):
        for path in sorted((ROOT / folder).glob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if module not in known:
                found.append(str(path.relative_to(ROOT)))
    return found


def main() -> int:
    """Apply the table (or, with --check, say what it would do)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print what would move and change; touch nothing")
    args = parser.parse_args()
    moves = planned_moves()
    for src, dst, inside, deeper in moves:
        print(f"{'would move' if args.check else 'move'}: {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
        if args.check:
            continue
        if dst.exists():
            print(f"conflict: {dst.relative_to(ROOT)} exists already; {src.relative_to(ROOT)} left in place")
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
        keep_file_paths(dst, inside, deeper)
    for wing, doc in WINGS.items():
        init = ROOT / wing / "__init__.py"
        if doc is None or init.exists():
            continue
        print(f"{'would create' if args.check else 'create'}: {init.relative_to(ROOT)}")
        if not args.check:
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{doc}\n"""\n')
            git("add", str(init.relative_to(ROOT)))
    if not args.check:
        for folder in DISSOLVED:
            rest = [p for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"]
            if (ROOT / folder / "__init__.py").exists() and not rest:
                print(f"remove: {folder}/__init__.py (every module moved)")
                git("rm", "-qf", f"{folder}/__init__.py")
        for empty in sorted((ROOT / "payments").rglob("*"), reverse=True):
            if "__pycache__" in empty.parts:
                continue
            if empty.is_dir() and not any(p for p in empty.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
                for junk in sorted(empty.rglob("*"), reverse=True):
                    junk.rmdir() if junk.is_dir() else junk.unlink()
                empty.rmdir()
    new = new_names()
    changed, stale = 0, []
    for path in tracked():
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        if path.suffix == ".py":
            rewritten = rewrite_python(text, new)
        else:
            rewritten = rewrite_text(text, new, sql=path.suffix == ".sql")
        if path.suffix == ".py" and rewritten != text:
            rewritten = wrap_long_lines(rewritten)
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(rewritten.splitlines(), start=1):
            stale += [f"{rel}:{lineno}: names {f}" for f in DISSOLVED if f in line or f.replace("/", ".") in line]
        if rewritten != text:
            changed += 1
            if args.check:
                print(f"would rewrite: {rel}")
            else:
                path.write_text(rewritten, encoding="utf-8", errors="surrogateescape")
    print(f"{'would rewrite' if args.check else 'rewrote'} {changed} file(s)")
    for path in unplaced():
        print(f"unplaced: {path}")
    for line in stale:
        print(f"stale: {line}, which the moves dissolve (fix by hand)")
    if not args.check and changed:
        print("now: .venv/bin/ruff check --fix . && .venv/bin/ruff format .")
    return 0


if __name__ == "__main__":
    sys.exit(main())
