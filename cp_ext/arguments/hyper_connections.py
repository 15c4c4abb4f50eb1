"""Manifold-constrained hyper-connections (DeepSeek-V4's mHC), Megatron-LM's flags (`cp_ext.transformer.hyper_connections`).

Megatron-LM main spells them ``--enable-mhc-connections`` and ``--mhc-num-residual-streams``; its DeepSeek-V4 branch
``--enable-hyper-connections`` and ``--num-residual-streams``. Both are taken.

``--enable-hyper-connections`` keeps ``--num-residual-streams`` residual streams per token (V4: 4) instead of one,
mixed around every attention and MLP block by a doubly stochastic matrix from ``--mhc-sinkhorn-iterations``
Sinkhorn normalizations (V4: 20).
"""

from cp_ext.flag_types import POSITIVE


def add_hyper_connection_args(g):
    # Megatron-LM main's names (TransformerConfig.enable_mhc_connections, mhc_num_residual_streams) and the DeepSeek-V4
    # branch's (enable_hyper_connections, num_residual_streams): one flag each, either spelling
    g.add_argument("--enable-hyper-connections", "--enable-mhc-connections", dest="enable_hyper_connections",
                   action="store_true",
                   help="manifold-constrained hyper-connections (DeepSeek-V4): --num-residual-streams streams per "
                        "token, mixed around every block")
    g.add_argument("--num-residual-streams", "--mhc-num-residual-streams", dest="num_residual_streams",
                   type=POSITIVE, default=4,
                   help="with --enable-hyper-connections: residual streams per token (default 4)")
    g.add_argument("--mhc-sinkhorn-iterations", type=POSITIVE, default=20,
                   help="with --enable-hyper-connections: Sinkhorn normalizations of the stream mixing (default 20, "
                        "DeepSeek-V4's)")


def hyper_connection_problems(args):
    """Configuration errors of the hyper-connection flags, naming the flag and the fix."""
    if not args.enable_hyper_connections:
        given = [flag for flag, dest, default in (("--num-residual-streams", "num_residual_streams", 4),
                                                  ("--mhc-sinkhorn-iterations", "mhc_sinkhorn_iterations", 20))
                 if getattr(args, dest) != default]
        return [f"{flag} is only read with --enable-hyper-connections; add it or drop {flag}" for flag in given]
    p = []
    if args.hidden_dropout:
        p.append(f"--enable-hyper-connections mixes the blocks' outputs into the streams without megatron's "
                 f"bias-dropout-add: --hidden-dropout {args.hidden_dropout} is not supported with it; set 0")
    if args.recompute_granularity == "selective":
        p.append("--recompute-granularity selective is not supported with --enable-hyper-connections yet; drop it")
    return p
