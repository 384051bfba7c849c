"""The commands README.md shows."""

from __future__ import annotations

import re
import shlex

from support.repository import ROOT

README = ROOT / "README.md"


def readme_megatron_commands() -> dict[str, list[str]]:
    """The commands of README.md's Megatron section: script -> its arguments (after the launcher)."""
    with open(README) as f:
        text = f.read()
    section = text[text.index("## Megatron-LM / Megatron-Core") : text.index("## DeepSpeed")]
    commands = {}
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        words = shlex.split(block.replace("\\\n", " "))
        assert words[:3] == ["python", "-m", "dion3_megatron.megatron.launch"], words[:4]
        commands[words[3]] = words[4:]
    return commands
