"""DiLoCo itself: the outer loop a worker group runs between its inner steps. Plain torch, no hivemind.

- ``loop``: what the training loop calls (``OuterLoop``, ``OuterReport``) and ``NoOuter`` for a group alone;
- ``build``: the one builder that composes a group's loop with its swarm;
- ``diloco``: ``DiLoCo``, the loop of a group in a swarm (join, rounds, landing, catch-up, settle);
- ``optimizer``: the outer parameters and their Nesterov SGD; ``auto``: what ``auto`` picks for it;
- ``pace``: when rounds are due (every H inner steps, or a token budget); ``fragments`` and ``inflight``: streaming
  rounds and rounds that overlap the inner steps;
- ``catchup``: whose state to load and whether what came is it; ``claims``: one world rank, one group;
  ``agreement``: what the groups of a run must share; ``rows``: the metrics row of an outer step;
- ``links``: the ``Swarm`` and ``Group`` protocols the loop talks through; ``memory``: an in-memory swarm for tests
  and benches (``diloco.swarm.peer.SwarmPeer`` is the real one).
"""
