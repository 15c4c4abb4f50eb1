"""Instrumentation the attention test workers share: what the collectives were asked to send."""


def record_all_to_all():
    """Patch ``dist.all_to_all_single`` to log the shape of every send buffer; returns the log."""
    import torch.distributed as dist

    log, orig = [], dist.all_to_all_single

    def patched(output, input, *a, **kw):
        log.append(tuple(input.shape))
        return orig(output, input, *a, **kw)

    dist.all_to_all_single = patched
    return log
