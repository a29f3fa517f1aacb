"""File and message formats other tools read: OpenVDB (``vdb``), NanoVDB (``nanovdb``), 2D cost grids
(``costmap``)."""
