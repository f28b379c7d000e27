"""docs/reference/settings.md is generated from the settings' field docs, and says what the code says."""

from __future__ import annotations

import dataclasses

from payments.infra import settings_reference
from payments.infra.settings import Settings, env_name

PAGE = settings_reference.REFERENCE_PATH


def test_the_committed_reference_is_what_the_code_generates():
    found = settings_reference.problems(PAGE.read_text(encoding="utf-8"))
    assert found == [], (
        f"docs/reference/settings.md is out of date with {settings_reference.SOURCE}; regenerate it with "
        f"`{settings_reference.REGENERATE}` and commit the result:\n  " + "\n  ".join(found)
    )


def test_every_setting_has_a_real_description():
    docs = settings_reference.field_docs()
    thin = [f.name for f in dataclasses.fields(Settings) if len(docs.get(f.name, "").split()) < 4]
    assert thin == [], f"settings without a real docstring in {settings_reference.SOURCE}: {thin}"


def test_every_setting_has_one_row_with_its_default_and_its_docstring():
    table = settings_reference.table(PAGE.read_text(encoding="utf-8"))
    assert list(table) == [env_name(f.name) for f in dataclasses.fields(Settings)]
    assert table["PORT"] == ("`8000`", "Port the gateway listens on.")
    assert table["DATABASE_URL"][0] == "`sqlite:///var/paysync.db`"
    assert table["MERCHANT_API_TOKEN"][0] == "empty (development: `dev-merchant-token`)"


def test_a_missing_setting_is_named():
    text = "\n".join(line for line in settings_reference.render().splitlines() if not line.startswith("| `PORT` |"))
    assert settings_reference.problems(text) == ["PORT is missing"]


def test_a_setting_described_differently_is_named_with_both_texts():
    text = settings_reference.render().replace("Port the gateway listens on.", "Port the gateway used to listen on.")
    found = settings_reference.problems(text)
    assert len(found) == 1 and found[0].startswith("PORT is described differently"), found
    assert "Port the gateway used to listen on." in found[0] and "Port the gateway listens on." in found[0]


def test_a_wrong_default_and_a_retired_setting_are_named():
    text = settings_reference.render().replace("| `PORT` | `8000` |", "| `PORT` | `8080` |")
    text += "| `ALERT_BACKLOG_THRESHOLD` | `100` | retired |\n"
    assert settings_reference.problems(text) == [
        "ALERT_BACKLOG_THRESHOLD is not a setting (any more)",
        "PORT: the page says default `8080`, the code `8000`",
    ]


def test_a_pipe_in_a_description_stays_inside_its_cell():
    assert settings_reference.describe("a | b ``c``") == "a \\| b `c`"
    row = f"| `X` | `1` | {settings_reference.describe('a | b')} |"
    assert settings_reference.table(row) == {"X": ("`1`", "a \\| b")}


def test_the_command_checks_and_rewrites_the_page(tmp_path, monkeypatch, capsys):
    from payments.__main__ import main

    assert main(["settings-reference", "--check"]) == 0, capsys.readouterr().err
    stale = tmp_path / "settings.md"
    stale.write_text(PAGE.read_text(encoding="utf-8").replace("Port the gateway listens on.", "Port."))
    monkeypatch.setattr(settings_reference, "REFERENCE_PATH", stale)
    assert main(["settings-reference", "--check"]) == 1
    said = capsys.readouterr().err
    assert "PORT is described differently" in said and f"regenerate it: {settings_reference.REGENERATE}" in said
    assert main(["settings-reference"]) == 0
    assert stale.read_text(encoding="utf-8") == settings_reference.render()
