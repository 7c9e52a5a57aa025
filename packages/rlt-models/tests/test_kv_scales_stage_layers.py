"""fp8 KV scales of a family with stage layers (Huginn: prelude and coda layers keep KV on the
stage plane, whose slot l shares scale l with the loop planes' slot l): calibration runs the
prelude and the coda too, so a prelude whose keys and values are 8 times larger raises the
scales of its slots (rlt_models.kv_scales).

Why at least 2x: a slot's scale is the power of two at or above 2 max / 448 over the prelude's
and the core's values there. Before, the prelude's maximum p and the core's c are within 1.4x of
each other in this model (at most 1.31x; sandwich norms keep every block's K/V alike), so
before <= P2(2 * 1.4 p / 448); after >= P2(2 * 8 p / 448), and P2 rounds up by less than 2x: the
ratio is at least 8 / 1.4 / 2 > 2. A calibration that skipped the stage layers would leave these
scales as they were (the core's inputs are normed, whatever the prelude's attention outputs).
"""

from __future__ import annotations

from rlt_models import RandomInit, load_model, write_random_checkpoint
from rlt_models.huginn_config import HuginnConfig
from rlt_models.kv_scales import calibrate_kv_scales
from safetensors.torch import load_file, save_file

CONFIG = HuginnConfig(
    vocab_size=320,
    n_embd=64,
    n_heads=4,
    n_layers_in_prelude=2,
    n_layers_in_recurrent_block=4,
    n_layers_in_coda=2,
    intermediate_size=96,
    mean_recurrence=4,
    block_size=256,
    eos_token_id=(319,),
)
TOKENS = list(range(3, 120))


def test_calibration_covers_the_prelude_and_coda_slots(tmp_path):
    path = write_random_checkpoint(tmp_path, CONFIG, seed=3, init=RandomInit(weight_std=0.1))
    plain = calibrate_kv_scales(load_model(path, dtype="float32"), TOKENS)
    weights = load_file(str(path / "model.safetensors"))
    for layer in range(CONFIG.n_layers_in_prelude):  # the prelude's K and V (not its queries)
        name = f"transformer.prelude.{layer}.attn.Wqkv.weight"
        width = CONFIG.n_embd
        weights[name][width:] *= 8.0
        weights[f"transformer.prelude.{layer}.attn.qk_bias"][1] *= 8.0
    save_file(weights, str(path / "model.safetensors"))
    louder = calibrate_kv_scales(load_model(path, dtype="float32"), TOKENS)
    for plain_scales, louder_scales in zip(plain, louder, strict=True):  # keys, then values
        for slot in range(CONFIG.n_layers_in_prelude):
            assert louder_scales[slot] >= 2 * plain_scales[slot]
