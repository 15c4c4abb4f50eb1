"""The attention mask as data: causal, sliding windows and packed documents, and the tiles they leave.

    tiles.py      `Window`, `Band`, `Block`, `plan_tile`: one tile of (q rows, k rows) as masked rectangles
    documents.py  packed documents: ``document_ids`` checks and the runs of one document along a shard

The names below were importable from ``cp_ext.attention.masks`` when it was one module; they still are.
"""

from cp_ext.attention.masks.tiles import Band, Block, Window, make_window, plan_tile, position_runs, tile_span

__all__ = ["Band", "Block", "Window", "make_window", "plan_tile", "position_runs", "tile_span"]
