"""The media towers at a real width on the GPU: our soft tokens against transformers' (fp32; eager attention,
SDPA for the audio tower, whose eager mask transformers inverts), and the time one image or clip takes.
Gemma 3's SigLIP (So400m: 27 layers, hidden 1152, 896 px), Gemma 4's vision tower (16 layers, hidden 768,
16 px patches pooled 3×3, 280 soft tokens) and Gemma 4's audio tower (its configuration's defaults, the
E2B/E4B one: 12 conformer layers, hidden 1024), each with transformers' own classes and a seeded random init
scaled so that its outputs depend on the input (norms near one, matrices of std 1/sqrt(fan_in)), handed to
our loader tensor by tensor. Images: three of fixtures/media; audio: its 16 kHz clips.

    python3 benchmarks/gpu_towers.py --out $OUT
"""

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from PIL import Image
from transformers import (
    Gemma3Config,
    Gemma3ImageProcessorPil,
    Gemma3TextConfig,
    Gemma4AudioConfig,
    Gemma4ImageProcessorPil,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    Gemma4VisionModel,
    SiglipVisionConfig,
    SiglipVisionModel,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder

from spinf_jax import audio
from spinf_jax.checkpoint import _aliases
from spinf_jax.loader import load_weights
from spinf_jax.media import PatchedImages, SquareImages
from spinf_jax.models import gemma4_audio, gemma4_vision, siglip
from spinf_jax.quant import Precision

MEDIA = Path(__file__).resolve().parent.parent / "fixtures" / "media"
IMAGES = ["gradient.png", "stripes.png", "grey.png"]
CLIPS = ["tone.wav", "click-8bit.wav", "noise-8k.wav"]  # wav: the device image has no mp3 decoder
TEXT_HIDDEN = 2560  # Gemma 3 4B's and Gemma 4 E4B's text width


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "q_norm" in name or "k_norm" in name:  # Gemma 4 attends with scale 1: its q/k norms scale
            value = p.shape[0] ** -0.25 * (1.0 + 0.1 * noise)
        elif "norm" in name and name.endswith("weight") and p.ndim == 1:
            value = 1.0 + 0.1 * noise
        elif p.ndim == 1 or "position" in name:
            value = 0.1 * noise
        else:  # [out, in] (conv kernels: [out, in · kh · kw]); Gemma 3's projector is [in, out]
            fan_in = p[0].numel() if "mm_input_projection" not in name else p.shape[0]
            value = noise / fan_in**0.5
        with torch.no_grad():
            p.copy_(value)


class Weights:
    """transformers modules' tensors under the names our towers load (a checkpoint for load_weights)."""

    def __init__(self, parts: dict[str, torch.nn.Module], config: dict):
        self.config = config
        self.state = {f"{prefix}{k}": v for prefix, m in parts.items() for k, v in m.state_dict().items()}

    def get(self, name: str) -> np.ndarray:
        stored = next(alias for alias in _aliases(name) if alias in self.state)
        return self.state[stored].float().cpu().numpy()


# Each tower below: (its config.json dict, its transformers modules by checkpoint prefix, a function making
# our abstract tower at a precision, its cases: (what our tower takes, rows that are the input's,
# transformers' soft tokens [rows, text hidden] as f32 numpy)).


def gemma3(dev: str):
    vision = SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    )
    vision._attn_implementation = "eager"
    full = Gemma3Config(text_config=Gemma3TextConfig(hidden_size=TEXT_HIDDEN), vision_config=vision)
    config = {
        "model_type": "gemma3",
        "vision_config": vision.to_dict(),
        "text_config": {"hidden_size": TEXT_HIDDEN},
    }
    tower = SiglipVisionModel(vision).eval().to(dev)
    projector = Gemma3MultiModalProjector(full).eval().to(dev)
    randomize(tower, 0)
    randomize(projector, 1)
    fmt = SquareImages(2, 1 / 255, 0, 0, 0, "\n\n", 896, 896)
    processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})

    def reference(image):
        pixels = processor([image], return_tensors="pt")["pixel_values"].to(dev)
        with torch.no_grad():
            return projector(tower(pixels).last_hidden_state)[0]

    parts = {"vision_tower.": tower, "multi_modal_projector.": projector}  # as the released files
    return config, parts, _tower(siglip, config), _image_cases(fmt, reference)


def gemma4(dev: str):
    vision = Gemma4VisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
        num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3, standardize=True,
    )  # fmt: skip
    vision._attn_implementation = "eager"
    config, tower, embed = _gemma4_tower(vision, Gemma4VisionModel, "vision", dev)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)  # drawn on the CPU, as randomize's
        tower.std_bias.copy_(torch.randn(tower.std_bias.shape, generator=g))
        tower.std_scale.copy_(torch.empty(tower.std_scale.shape).uniform_(0.5, 1.5, generator=g))
    fmt = PatchedImages(3, 1 / 255, 0, 0, 0, "", 16, 3, 280)
    processor = Gemma4ImageProcessorPil(max_soft_tokens=280)

    def reference(image):
        inputs = processor([image], return_tensors="pt")
        with torch.no_grad():
            out = tower(inputs["pixel_values"].to(dev), inputs["image_position_ids"].to(dev))
            return embed(out.last_hidden_state)

    parts = {"model.vision_tower.": tower, "model.embed_vision.": embed}
    return config, parts, _tower(gemma4_vision, config), _image_cases(fmt, reference)


def gemma4_audio_tower(dev: str):
    heard = Gemma4AudioConfig()
    heard._attn_implementation = "sdpa"
    config, tower, embed = _gemma4_tower(heard, Gemma4AudioModel, "audio", dev)
    with torch.no_grad():  # clip bounds wide enough to clip rarely (transformers' defaults are infinite)
        for name, b in tower.named_buffers():
            if name.endswith(("_min", "_max")):
                b.fill_(-8.0 if name.endswith("_min") else 8.0)
    features = audio.FeatureConfig()
    cases = []
    for name in CLIPS:
        samples = audio.read((MEDIA / name).read_bytes(), name[-3:], name, features)
        f, m = audio.features(samples, features)
        n = audio.soft_token_count(len(samples), features)
        with torch.no_grad():
            out = tower(torch.tensor(f)[None].to(dev), torch.tensor(m)[None].to(dev))
            want = embed(out.last_hidden_state)[0, :n].float().cpu().numpy()
        cases.append((gemma4_audio.pad_frames(f, m), n, want))

    def make(precision):  # our audio tower returns (soft tokens, their mask)
        cfg = gemma4_audio.Config.from_hf(config)
        return nnx.eval_shape(lambda: gemma4_audio.AudioTower(cfg, Precision(precision)))

    parts = {"model.audio_tower.": tower, "model.embed_audio.": embed}
    return config, parts, make, cases


def _gemma4_tower(tower_config, tower_class, kind: str, dev: str):
    """A Gemma 4 tower and its embedder into a TEXT_HIDDEN-wide decoder, seeded: (the config.json dict our
    loader reads, the tower, the embedder)."""
    text = Gemma4TextConfig(hidden_size=TEXT_HIDDEN)
    config = {"model_type": "gemma4", f"{kind}_config": tower_config.to_dict(), "text_config": text.to_dict()}
    tower = tower_class(tower_config).eval().to(dev)
    embed = Gemma4MultimodalEmbedder(tower_config, text).eval().to(dev)
    randomize(tower, 0)
    randomize(embed, 1)
    return config, tower, embed


def _tower(family, config: dict):
    def make(precision):
        cfg = family.Config.from_hf(config)
        return nnx.eval_shape(lambda: family.VisionTower(cfg, Precision(precision)))

    return make


def _image_cases(fmt, reference) -> list:
    cases = []
    for name in IMAGES:
        image = Image.open(MEDIA / name)
        want = reference(image).float().cpu().numpy()
        cases.append((fmt.tower_inputs(image, name), fmt.soft_count(image.size, name), want))
    return cases


def measure(name: str, build, dev: str) -> dict:
    """A tower's max |Δ| against transformers over its cases, in fp32 and bf16, and the ms one input takes
    (20 calls of the last case after a warm-up)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config, parts, make, cases = build(dev)
    weights = Weights(parts, config)
    result = {"tower": name}
    for precision in ("fp32", "bf16"):
        ours = make(precision)
        load_weights(ours, weights)
        graph, state = nnx.split(ours)
        state = nnx.to_pure_dict(state)

        def soft(g, w, *x):
            out = nnx.merge(g, w)(*x)
            return out[0] if isinstance(out, tuple) else out

        run = jax.jit(soft, static_argnums=0)
        gaps, scale = [], 0.0
        for inputs, n, want in cases:
            inputs = [jnp.asarray(x) for x in inputs]
            got = np.asarray(run(graph, state, *inputs)[:n], np.float32)
            assert got.shape == want.shape, (got.shape, want.shape)
            gaps.append(float(np.abs(got - want).max()))
            scale = max(scale, float(np.abs(want).max()))
        jax.block_until_ready(run(graph, state, *inputs))
        start = time.perf_counter()
        for _ in range(20):
            out = run(graph, state, *inputs)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - start) / 20 * 1e3
        result[precision] = {"max_abs_diff": max(gaps), "max_abs_value": scale, "ms_per_input": ms}
        print(f"{name} {precision}: max |Δ| {max(gaps):.3g} (values up to {scale:.3g}), {ms:.2f} ms an input")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=".")
    parser.add_argument("--towers", default="gemma3-siglip-so400m,gemma4-vision,gemma4-audio")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": str(jax.devices()[0]), "torch_device": dev, "jax": jax.__version__}
    towers = [
        ("gemma3-siglip-so400m", gemma3),
        ("gemma4-vision", gemma4),
        ("gemma4-audio", gemma4_audio_tower),
    ]
    chosen = args.towers.split(",")
    results["towers"] = [measure(name, build, dev) for name, build in towers if name in chosen]
    (Path(args.out) / "gpu_towers.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| tower | precision | max abs diff vs transformers fp32 | largest value | ms per image or clip |")
    print("|---|---|---|---|---|")
    for r in results["towers"]:
        for p in ("fp32", "bf16"):
            m = r[p]
            cells = [
                r["tower"],
                p,
                f"{m['max_abs_diff']:.3g}",
                f"{m['max_abs_value']:.3g}",
                f"{m['ms_per_input']:.2f}",
            ]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
