"""docs/cli.md stays in step with the commands (regenerate with scripts/gen_cli_docs.py)."""

from pathlib import Path

from kvhub.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


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
