"""A torchtitan 0.3.0 config registry: its ``llama3_torchft_debugmodel`` made to run on CPU.

Used as ``--module titan_ft_cpu_config --config llama3_torchft_debugmodel_cpu`` (torchtitan's
ConfigManager imports a fully qualified module and takes the named function from it). It starts
from torchtitan's own ``torchtitan.experiments.torchft.llama3.config_registry.
llama3_torchft_debugmodel`` (same model: llama3 "debugmodel", 6 layers, dim 256, vocab 2048; same
FaultTolerantTrainer, TorchFTOptimizersContainer, TorchFTCheckpointManager) and changes only what a
2-core CPU run needs. Each change says why. Knobs come from the environment (set by run.sh):

  TITAN_FT_SEMI_SYNC  "none" (default): per-step FT, torchft.Manager quorum every step,
                      torchft.Optimizer commit gate, gradients averaged through
                      torchft.process_group.ManagedProcessGroup in FSDP's all-reduce hook.
                      "diloco" / "local_sgd": torchtitan's semi-sync path (torchft.local_sgd);
                      the registry itself says "diloco" with 2 fragments and sync_steps 10.
  TITAN_FT_SYNC_STEPS semi-sync period (default 2; diloco runs with 1 fragment so that a
                      5-step run syncs more than once)
  TITAN_FT_STEPS      training steps (default 5)
  TITAN_FT_SEQ_LEN    sequence length (default 64)
  TITAN_FT_BATCH      local batch size (default 2)
  TITAN_FT_CKPT       "1" (default): checkpoint.enable, which is also what makes torchtitan
                      register state_dict fns with the Manager (needed for a live heal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask

from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel
from torchtitan.models.common.attention import FlexAttention


class DenseMaskFlexAttention(FlexAttention):
    """FlexAttention's inputs and masks, computed with SDPA over the dense mask: trainable on CPU.

    torch's flex_attention refuses a backward on CPU ("FlexAttention does not support backward
    on CPU"), and torchtitan 0.3.0 offers language models only "flex" and the CUDA-only
    "varlen" (``models/common/config_utils.py get_attention_config``). This keeps FlexAttention's
    Config type (so ``Decoder.get_attention_masks`` still builds the same causal + packed-
    document BlockMask) and evaluates that mask densely (``create_mask``) with
    ``F.scaled_dot_product_attention``, which has a CPU backward. Same result, O(L^2) memory:
    fine at debug sizes only.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(
        self,
        q_BLNH,
        k_BLNH,
        v_BLNH,
        *,
        attention_masks: BlockMask,
        scale=None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        B, L, S = q.shape[0], q.shape[2], k.shape[2]
        mask = create_mask(attention_masks.mask_mod, B, 1, L, S, device=q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def llama3_torchft_debugmodel_cpu():
    config = llama3_torchft_debugmodel()

    semi = os.environ.get("TITAN_FT_SEMI_SYNC", "none")
    ft = config.fault_tolerance
    ft.process_group = "gloo"  # the registry says "nccl": no CUDA here
    ft.semi_sync_method = None if semi == "none" else semi
    ft.sync_steps = int(os.environ.get("TITAN_FT_SYNC_STEPS", "2"))
    if semi == "diloco":
        ft.num_fragments = 1

    tr = config.training
    tr.steps = int(os.environ.get("TITAN_FT_STEPS", "5"))
    tr.seq_len = int(os.environ.get("TITAN_FT_SEQ_LEN", "64"))
    tr.local_batch_size = int(os.environ.get("TITAN_FT_BATCH", "2"))
    tr.disable_cuda_graphs = True  # eager anyway off CUDA; skips a warning path
    tr.mixed_precision_param = "float32"  # bf16 matmuls are slow on this CPU
    tr.gc_freq = 1000

    # The registry turns the profiler on (torch.profiler every 10 steps): noise on CPU.
    config.profiler.enable_profiling = False
    # Validation every 5 steps, 10 steps each: more time than the training itself here.
    config.validator.enable = False
    # Selective activation checkpointing: recompute costs CPU time and buys nothing at this size.
    config.activation_checkpoint = None  # = the CLI's "activation-checkpoint:none"

    # FlexAttention cannot be trained on CPU (see DenseMaskFlexAttention): swap every
    # inner_attention config of the model for the dense-mask one, through torchtitan's own
    # config traversal (no torchtitan file changes).
    model = config.model_spec.model
    for _fqn, cfg, parent, attr in model.traverse(FlexAttention.Config):
        new = DenseMaskFlexAttention.Config(
            block_size=cfg.block_size, kernel_options=cfg.kernel_options
        )
        if parent is None:
            raise RuntimeError("the model config itself is a FlexAttention config?")
        if isinstance(attr, int):
            parent[attr] = new
        else:
            setattr(parent, attr, new)

    ck = config.checkpoint
    ck.enable = os.environ.get("TITAN_FT_CKPT", "1") == "1"
    ck.interval = int(os.environ.get("TITAN_FT_CKPT_INTERVAL", "1000"))
    config.comm.train_timeout_seconds = 60
    config.comm.init_timeout_seconds = 120
    config.dump_folder = os.environ.get("TITAN_FT_DUMP", "./outputs")
    return config
