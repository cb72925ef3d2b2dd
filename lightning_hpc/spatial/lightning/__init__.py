"""The Lightning adapter of spatial parallelism: :mod:`.strategy` (``SpatialParallelStrategy``,
``Trainer(strategy="spatial")``) and :mod:`.metrics` (torchmetrics objects counting every pixel and sample once
under a split).  The only layer of ``spatial/`` that Lightning or torchmetrics reaches; this ``__init__`` imports
nothing, so the plain-torch layers below never load Lightning through it (the registry imports
:mod:`.strategy` lazily).
"""
