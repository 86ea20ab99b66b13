"""The errors every layer raises for bad input: each becomes one line on stderr and exit code 2 at the command line
(``diloco.cli.app``), never a traceback."""

from __future__ import annotations

import re
from collections.abc import Callable


class UsageError(ValueError):
    """Bad user input: reported as one line naming the flag or file, exit code 2, no traceback. Under torchrun
    only rank 0 reports it: every rank sees the same input."""


class RankUsageError(UsageError):
    """Bad input that only this rank meets (e.g. its own port, the given one + local rank): every rank that
    meets it reports it, naming itself."""


class FieldError(UsageError):
    """Bad input met below the command line, naming the config fields it concerns instead of flags: lower layers
    know fields, not how a command spells them. The message holds each field as a placeholder, ``{dataset}`` or
    ``{ckpt.resume}``; the command line turns them into its flags (``spelled``: ``--dataset``, ``--ckpt.resume``).

    A layer given a slice of the config (the swarm gets ``Config.hv``) names that slice's fields
    (``{world_rank}``); whoever handed it the slice puts the slice's name in front (``within("hv")``). A field of
    the whole config that the layer was handed as a plain value (the swarm's ``final_step`` is ``max_steps``) is
    written from the root, ``{/max_steps}``, and keeps its name.

    :param message: the line to show, with ``{field}`` placeholders.
    :param per_rank: only this rank meets it (see ``RankUsageError``).
    """

    def __init__(self, message: str, per_rank: bool = False) -> None:
        super().__init__(_FIELD.sub(lambda m: m.group(2), message))
        self.message, self.per_rank = message, per_rank

    @property
    def fields(self) -> list[str]:
        return [name for _, name in _FIELD.findall(self.message)]

    def within(self, prefix: str) -> FieldError:
        """The same error with every field under ``prefix`` (``world_rank`` -> ``hv.world_rank``) but those written
        from the root (``{/max_steps}``)."""
        return FieldError(_FIELD.sub(lambda m: m.group(0) if m.group(1) else f"{{{prefix}.{m.group(2)}}}",
                                     self.message), self.per_rank)  # fmt: skip

    def spelled(self, spell: Callable[[str], str]) -> UsageError:
        """This error as a command line reports it, each field spelled by ``spell`` (field -> flag)."""
        kind = RankUsageError if self.per_rank else UsageError
        return kind(_FIELD.sub(lambda m: spell(m.group(2)), self.message))


_FIELD = re.compile(r"\{(/?)([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)\}")


def first_line(error: BaseException) -> str:
    """The gist of a library's error, to quote inside a one-line UsageError."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
