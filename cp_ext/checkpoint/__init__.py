"""cp_ext's checkpoints, in Megatron-LM's torch_dist layout: everything about the disk format in one place.

    disk_format.py   the directory, tracker and meta.json, and the atomic publish (no torch, no megatron)
    checks.py        parse-time checks on --load / --save, before any process group or model exists
    lock.py          one job saves into a directory at a time
    state.py         what each part of training saves and loads (the state-dict protocol)
    checkpointer.py  save and load with megatron's dist_checkpointing, at any grid

The submodules are imported where used: the parse-time layer reads `disk_format` and `checks` without
importing torch's checkpoint machinery or megatron.
"""
