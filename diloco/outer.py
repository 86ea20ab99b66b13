"""The outer loop that wraps the inner training step. With galaxy size 1 it does nothing."""

from __future__ import annotations

from typing import Any, Protocol


class OuterLoop(Protocol):
    """Called by the training loop after every inner step; owns whatever happens between worker groups."""

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        """Run the outer step when one is due; return its metrics row, or None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NoOuter:
    """Galaxy size 1: plain torch.distributed training, no DHT, no averaging."""

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
