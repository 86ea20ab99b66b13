"""Network namespaces (`ip netns`, needs root): those that exist, and that a bench left none of its own behind."""

from __future__ import annotations

import re
import subprocess


def namespaces() -> set[str]:
    """Names of the network namespaces that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def assert_none_left(before: set[str], used: set[str]) -> None:
    """None of `used` exists any more, nor any other namespace of the same bench run (same name prefix) that
    was not there before: what other tests make meanwhile is theirs."""
    tags = {re.sub(r"n\d+$", "", name) for name in used}
    after = namespaces()
    assert not used & after, used & after
    assert not {name for name in after - before if re.sub(r"n\d+$", "", name) in tags}
