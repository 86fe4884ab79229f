"""docs/cli.md stays in step with the commands (regenerate with scripts/gen_cli_docs.py)."""

from pathlib import Path

from kvhub.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_is_documented():
    text = (ROOT / "docs" / "cli.md").read_text()
    for name, command in main.commands.items():
        assert f"## kvhub {name}\n" in text, f"kvhub {name} missing from docs/cli.md: run scripts/gen_cli_docs.py"
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--"):
                    assert opt in text, f"{opt} of kvhub {name} missing from docs/cli.md"


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _variables_table() -> str:
    from kvhub.env import VARIABLES

    rows = ["| variable | default | meaning | read by |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} | `{v.read_by}` |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


def test_every_environment_variable_is_declared_once_and_documented():
    """kvhub.env.VARIABLES lists every KVHUB_* variable the package names, each read by the module it says, and
    docs/configuration.md shows that table.  Planted bugs caught: a module reading a new KVHUB_ variable that
    VARIABLES does not list (KVHUB_DIST_TIMEOUT was in no doc); a stale reader or a doc row out of step."""
    import re

    from kvhub.core.deshrink import DESHRINK_DEFAULT
    from kvhub.env import VARIABLES

    declared = {v.name: v for v in VARIABLES}
    assert len(declared) == len(VARIABLES), "a variable is declared twice"
    named = {
        name
        for path in (ROOT / "kvhub").rglob("*.py")
        for name in re.findall(r"KVHUB_[A-Z0-9_]*[A-Z0-9]", path.read_text())
    }
    assert named <= set(declared), f"add to kvhub.env.VARIABLES: {sorted(named - set(declared))}"
    for variable in VARIABLES:
        reader = ROOT / (variable.read_by.replace(".", "/") + ".py")
        assert variable.name in reader.read_text(), f"{variable.read_by} does not read {variable.name}"
    assert f"`{DESHRINK_DEFAULT}`" == declared["KVHUB_DESHRINK"].default
    table = _variables_table()
    assert table in (ROOT / "docs" / "configuration.md").read_text(), (
        "docs/configuration.md is out of step with kvhub.env.VARIABLES; its table is:\n" + table
    )
