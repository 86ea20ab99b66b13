"""The wire side of the swarm: ``matchmaker`` (rank 0 finds the round's groups through hivemind), ``group_round``
(every rank's part of a round of whole groups), ``layout`` (who reduces what, for any shapes), ``tcp`` and
``frames`` (the round's protocol), ``listener`` and ``tunnel`` (where connections arrive), ``transfer`` (state
downloads), ``digest`` (one state, one digest, in any shape), ``codecs``, ``screening`` and ``aggregation``
(what a reducer accepts and how it combines), ``report`` (what a round tells the outer loop)."""
