"""Other trainers' spellings of the training flags: OpenDiLoCo's ``train_fsdp.py`` flags that this trainer names
differently are rewritten to its own; those with no meaning here are refused with one line saying what to do
instead. Everything else OpenDiLoCo takes is spelled the same here (``--path-model``, ``--total-steps``,
``--hv.local-steps``, ...; ``--attn-implementation`` and ``--ckpt.topk`` too), so a launch script needs only its
``train_fsdp.py`` replaced by ``-m diloco.train``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diloco.errors import UsageError

# flag -> its spelling here
RENAMED = {
    "--dataset-name-or-path": "--dataset",
    "--hv.timeout-waiting-for-peers": "--hv.matchmaking-time",
}
# --hv.hivemind-compression's values -> --hv.compression's; the others have no equal here
COMPRESSIONS = {"fp16": "fp16", "uniform8bit": "int8"}
# flag -> what to do instead
REFUSED = {
    "--num-workers": "data is tokenized once and read in the training process, without loader workers: drop it",
    "--log-activations-steps": "activations are not logged here: drop it (metrics.jsonl has the loss, the lr, "
    "tokens/s and each round's pseudo-gradient norm)",
    "--hv.all-reduce-strategy": "a round closes once every live group is in, or when the wait for the groups on "
    "their way ends (see --hv.matchmaking-time): drop it",
    "--hv.fail-rank-drop": "a group whose round fails applies nothing and catches up with the swarm at its next "
    "outer step: drop it",
}
C4_TINY = ["--dataset", "PrimeIntellect/c4-tiny", "--dataset-config", "en"]  # what OpenDiLoCo's --c4-tiny loads
TRUE = {"", "true", "1", "yes"}  # a bare boolean flag, or its explicit value
BOOLEANS = TRUE - {""} | {"false", "0", "no"}


def translate(argv: Sequence[str]) -> list[str]:
    """`argv` of a training command with OpenDiLoCo's spellings rewritten; a flag with no meaning here is a
    `UsageError` naming it. A token after a bare ``--`` is left as it is."""
    out: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return out + tokens[i:]
        name, eq, inline = token.partition("=")
        value = inline if eq else None
        if name == "--c4-tiny" and value is None and i + 1 < len(tokens) and tokens[i + 1].lower() in BOOLEANS:
            i += 1
            value = tokens[i]  # `--c4-tiny true`, as pydantic's flags take it

        def take() -> str:
            nonlocal i
            if value is not None:
                return value
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise UsageError(f"{name} needs a value")
            i += 1
            return tokens[i]

        out += _rewrite(name, take, value)
        i += 1
    return out


def _rewrite(name: str, take: Callable[[], str], value: str | None) -> list[str]:
    """The tokens that replace flag `name` (its value read by `take` where it has one)."""
    if name in REFUSED:
        raise UsageError(f"{name} (OpenDiLoCo): {REFUSED[name]}")
    if name in RENAMED:
        return [RENAMED[name], take()]
    if name == "--hv.hivemind-compression":
        given = take()
        if given.lower() not in COMPRESSIONS:
            raise UsageError(f"--hv.hivemind-compression {given} (OpenDiLoCo): no such format here; use "
                             "--hv.compression fp16, int8 or int4 (uniform8bit is int8)")  # fmt: skip
        return ["--hv.compression", COMPRESSIONS[given.lower()]]
    if name == "--c4-tiny":
        return C4_TINY if (value or "").lower() in TRUE else []
    if name == "--no-c4-tiny":
        return []
    return [name if value is None else f"{name}={value}"]
