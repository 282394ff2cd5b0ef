"""Framework adapters (Lightning, DeepSpeed, ...): the top layer, beside the CLI.

An adapter gives a framework's checkpoints stalwart's guarantees by standing on
the stable extension points below, and nothing else (no private names, no
knowledge of the on-disk layout beyond ``stalwart.layout``):

- ``stalwart.manager.CheckpointManager``: policy, commit, retention, the durable
  tier, restore with fallback, the exact-resume certificate;
- ``stalwart.state.TrainState``, or ``stalwart.restore_protocol.Restorable`` /
  ``RestorePlan`` for a framework's own state (``pipeline.load_checkpoint``
  accepts any such object);
- ``stalwart.pipeline`` (``open_save``, ``write_and_commit``, ``load_checkpoint``)
  and ``stalwart.distributed.Coordinator`` for an adapter that drives a save itself;
- ``stalwart.storage.base.CheckpointStorage`` for a primary tier of its own;
- ``stalwart.catalog`` and ``stalwart.layout`` to read runs; ``stalwart.errors``.

Adapters: ``stalwart.integrations.lightning`` (``StalwartCheckpointIO``, a
Lightning/Fabric ``CheckpointIO`` plugin, and the ``ExactResume`` callback;
docs/integrations.md). Each is imported by name, never from here, so the
framework stays an optional dependency.

Nothing in the library imports this package; see docs/architecture.md.
"""

__all__: list[str] = []
