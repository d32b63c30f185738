#!/usr/bin/env python
"""Write the device profiles the overlap benchmark's device-like compute reads.

    python benchmarks/profiles/make_profiles.py      # rewrites resnet50.json and bert_base.json

A profile lists a model's layers in forward order; each has its trainable tensors
(shape, float32) and its forward FLOPs per example. The time a layer takes on the
modelled device is a rule stated in the file: forward FLOPs x examples / the device's
sustained rate, the backward pass ``backward_factor`` times that (the input and the
weight gradients of a matrix product each cost one forward), and the optimizer's update
the bytes it moves / the device's memory bandwidth.

* ``resnet50``: Keras's ``keras.applications.ResNet50`` architecture (``weights=None``,
  224 x 224 x 3 input, 1000 classes), built here and read layer by layer: a convolution
  costs 2 x kh x kw x c_in x c_out x h_out x w_out, a dense layer 2 x in x out; a batch
  normalization goes with the convolution before it (its FLOPs are left out, < 1 %).
* ``bert_base``: BERT-base (12 encoder layers, hidden 768, 12 heads, feed-forward 3072,
  vocabulary 30522, 512 positions, 2 token types), sequence length 128, counted from
  its shapes: a dense layer 2 x in x out per token, attention scores and their use
  2 x 2 x seq x hidden per token; embeddings, layer norms and softmax left out; the
  masked-LM and next-sentence heads are left out too (the pooler is kept).

The modelled device sustains 30 TFLOP/s, so that ResNet-50 (7.7 GFLOPs forward per image
by the count above) trains at 30e12 / (3 x 7.7e9) = 1,300 images/s, about what a V100
reaches in mixed precision; its memory moves 900 GB/s (a V100's HBM2).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICE = {"name": "V100-class accelerator (mixed precision)", "tflops": 30.0, "memory_gbps": 900.0,
          "backward_factor": 2.0,
          "rule": "forward ms = forward FLOPs per example x batch / (tflops x 1e12) x 1e3; backward ms = "
                  "backward_factor x forward ms; optimizer update ms = parameters x 28 bytes (Adam: read "
                  "parameter, gradient, two moments; write parameter, two moments; float32) / memory_gbps"}


def resnet50() -> dict:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    layers: list[dict] = []
    for layer in model.layers:
        if not layer.trainable_weights:
            continue
        tensors = [list(w.shape) for w in layer.trainable_weights]
        if isinstance(layer, keras.layers.Conv2D):
            kh, kw, cin, cout = layer.kernel.shape
            _, h, w, _ = layer.output.shape
            layers.append({"name": layer.name, "tensors": tensors, "forward_flops": 2 * kh * kw * cin * cout * h * w})
        elif isinstance(layer, keras.layers.Dense):
            cin, cout = layer.kernel.shape
            layers.append({"name": layer.name, "tensors": tensors, "forward_flops": 2 * cin * cout})
        elif isinstance(layer, keras.layers.BatchNormalization):
            layers[-1]["tensors"] += tensors  # with its convolution
            layers[-1]["name"] += "+bn"
        else:
            raise SystemExit(f"unexpected layer with weights: {layer.name} ({type(layer).__name__})")
    return {"model": "ResNet-50", "source": "keras.applications.ResNet50(weights=None), 224x224x3, 1000 classes",
            "batch": 256, "batch_unit": "images per worker", "device": DEVICE, "layers": layers}


def bert_base(seq: int = 128) -> dict:
    h, ff, vocab, positions, types, n_layers = 768, 3072, 30522, 512, 2, 12
    layers: list[dict] = [{"name": "embeddings", "tensors": [[vocab, h], [positions, h], [types, h], [h], [h]],
                           "forward_flops": 0}]
    for i in range(n_layers):
        attention = {"name": f"encoder{i}.attention",
                     "tensors": [[h, h], [h], [h, h], [h], [h, h], [h], [h, h], [h], [h], [h]],
                     "forward_flops": seq * (2 * 4 * h * h + 2 * 2 * seq * h)}
        ffn = {"name": f"encoder{i}.feed_forward", "tensors": [[h, ff], [ff], [ff, h], [h], [h], [h]],
               "forward_flops": seq * 2 * 2 * h * ff}
        layers += [attention, ffn]
    layers.append({"name": "pooler", "tensors": [[h, h], [h]], "forward_flops": 2 * h * h})
    return {"model": "BERT-base", "source": f"BERT-base shapes (12 x 768, feed-forward 3072, vocabulary 30522), "
                                            f"sequence length {seq}",
            "batch": 64, "batch_unit": f"sequences of {seq} tokens per worker", "device": DEVICE, "layers": layers}


def _summary(profile: dict) -> dict:
    import math

    params = sum(math.prod(t) for layer in profile["layers"] for t in layer["tensors"])
    flops = sum(layer["forward_flops"] for layer in profile["layers"])
    return {"parameters": params, "gradient_bytes": 4 * params,
            "gradient_tensors": sum(len(layer["tensors"]) for layer in profile["layers"]),
            "forward_gflops_per_example": round(flops / 1e9, 3)}


def main() -> int:
    for stem, make in (("resnet50", resnet50), ("bert_base", bert_base)):
        profile = make()
        profile = {"model": profile.pop("model"), "written_by": "benchmarks/profiles/make_profiles.py",
                   **_summary(profile), **profile}
        (HERE / f"{stem}.json").write_text(json.dumps(profile, indent=1) + "\n")
        print(stem, {k: profile[k] for k in ("parameters", "gradient_tensors", "forward_gflops_per_example")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
