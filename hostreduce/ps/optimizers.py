"""Optimizers a parameter server applies on its host: SGD (momentum, Nesterov), Adam,
Adagrad and RMSprop (momentum, centered), on dense arrays and on rows, in place, with numpy.

The arithmetic is Keras 3's, operation for operation and in the variable's dtype
(``keras.optimizers.Adam.update_step``: ``alpha = lr * sqrt(1 - beta_2^t) / (1 -
beta_1^t)``, ``m += (g - m) * (1 - beta_1)``, ``v += (g^2 - v) * (1 - beta_2)``,
``var -= m * alpha / (sqrt(v) + epsilon)``, epsilon outside the square root and not
bias-corrected), so a ps matches Keras to float32 rounding (tests/test_ps_core.py checks
against Keras itself). Temporaries are reused (``out=``) so an apply streams through the
arrays a few times and allocates two buffers at most.

Rows (an embedding's gradient, duplicates already summed): SGD and Adagrad touch only
the given rows, which is exactly Keras's result, as a zero gradient leaves a row
unchanged. Momentum and Adam are different: in Keras every row's moments decay and
every row moves each step, as for the densified gradient. ``sparse="keras"`` (the
default) does the same, exact but O(table) per step on the ps;
``sparse="lazy"`` updates only the rows in the gradient (TensorFlow Addons' LazyAdam),
O(batch), the usual choice for large embeddings. (Keras's Adam squares an IndexedSlices'
rows before summing duplicates, so v differs from the squared gradient when ids
repeat; here duplicates are summed first: the lookup's gradient is their sum.)
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError

__all__ = ["HostOptimizer", "SGD", "Adam", "Adagrad", "RMSprop", "from_config", "from_keras"]


def _number(name: str, value: Any, *, low: float = 0.0, high: float | None = None, open_low: bool = False) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = (v > low if open_low else v >= low) and (high is None or v < high)
    if not ok:
        rng = f"{'>' if open_low else '>='} {low}" + (f" and < {high}" if high is not None else "")
        raise ConfigError(f"`{name}` must be a number {rng}. Received: {name}={value!r}")
    return float(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def _root(x: np.ndarray, epsilon: Any, outside: bool) -> np.ndarray:
    """A new array: ``sqrt(x + epsilon)``, or ``sqrt(x) + epsilon`` when ``outside``."""
    if outside:
        out = np.sqrt(x)
        out += epsilon
        return out
    out = x + epsilon
    np.sqrt(out, out=out)
    return out


class HostOptimizer:
    """Base: a subclass names its slots, initialises them and implements ``_dense``
    (every array of the same shape). ``apply_rows`` gathers, applies, scatters."""

    name = ""
    slots: tuple[str, ...] = ()

    def __init__(self, learning_rate: float = 0.01, sparse: str = "keras") -> None:
        self.learning_rate = _number("learning_rate", learning_rate, open_low=True)
        if sparse not in ("keras", "lazy"):
            raise ConfigError(f"`sparse` must be 'keras' or 'lazy'. Received: sparse={sparse!r}")
        self.sparse = sparse

    # ------------------------------------------------------------------ public
    def init_slots(self, value: np.ndarray) -> dict[str, np.ndarray]:
        # Written, not np.zeros_like: the kernel maps untouched zero pages lazily, and a
        # sparse apply would then pay a page fault per row it first touches (most of a
        # step's time on a large table, for as long as new rows keep appearing).
        return {s: np.full_like(value, 0) for s in self.slots}

    def apply_dense(self, value: np.ndarray, slots: Mapping[str, np.ndarray], grad: np.ndarray, step: int) -> None:
        """Apply ``grad`` to ``value`` (and ``slots``) in place; ``step`` counts from 1."""
        self._dense(value, slots, np.asarray(grad, dtype=value.dtype), step)

    def apply_rows(self, value: np.ndarray, slots: Mapping[str, np.ndarray], rows: np.ndarray,
                   grads: np.ndarray, step: int) -> None:
        """Apply gradient rows ``grads`` at unique local ``rows`` of ``value`` in place."""
        grads = np.asarray(grads, dtype=value.dtype)
        if self._rows_exact() or self.sparse == "lazy":
            # np.take: several times faster than fancy indexing for rows of a large array.
            sub = {s: np.take(a, rows, axis=0) for s, a in slots.items()}
            part = np.take(value, rows, axis=0)
            self._dense(part, sub, grads, step)
            value[rows] = part
            for s, a in slots.items():
                a[rows] = sub[s]
        else:
            dense = np.zeros_like(value)
            dense[rows] = grads
            self._dense(value, slots, dense, step)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "learning_rate": self.learning_rate, "sparse": self.sparse}

    # ------------------------------------------------------------------ subclass
    def _rows_exact(self) -> bool:
        """Whether updating only the given rows equals Keras's dense update."""
        return False

    def _dense(self, value: np.ndarray, slots: Mapping[str, np.ndarray], g: np.ndarray, step: int) -> None:
        raise NotImplementedError


class SGD(HostOptimizer):
    """``keras.optimizers.SGD``: ``m = m * momentum - g * lr; var += m`` (Nesterov:
    ``var += m * momentum - g * lr``); plain ``var -= g * lr`` without momentum."""

    name = "sgd"

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 sparse: str = "keras") -> None:
        super().__init__(learning_rate, sparse)
        self.momentum = _number("momentum", momentum, high=1.0)
        if not isinstance(nesterov, bool):
            raise ConfigError(f"`nesterov` must be a bool. Received: nesterov={nesterov!r}")
        self.nesterov = nesterov
        self.slots = ("momentum",) if self.momentum else ()

    def _rows_exact(self) -> bool:
        return not self.momentum

    def _dense(self, value: np.ndarray, slots: Mapping[str, np.ndarray], g: np.ndarray, step: int) -> None:
        lr = value.dtype.type(self.learning_rate)
        if not self.momentum:
            value -= g * lr
            return
        mu = value.dtype.type(self.momentum)
        m = slots["momentum"]
        gl = g * lr
        m *= mu
        m -= gl
        if self.nesterov:
            gl *= -1
            gl += m * mu
            value += gl
        else:
            value += m

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}


class Adam(HostOptimizer):
    """``keras.optimizers.Adam`` (no AMSGrad, no weight decay)."""

    name = "adam"
    slots = ("m", "v")

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, sparse: str = "keras") -> None:
        super().__init__(learning_rate, sparse)
        self.beta_1 = _number("beta_1", beta_1, high=1.0)
        self.beta_2 = _number("beta_2", beta_2, high=1.0)
        self.epsilon = _number("epsilon", epsilon)

    def _dense(self, value: np.ndarray, slots: Mapping[str, np.ndarray], g: np.ndarray, step: int) -> None:
        t = value.dtype.type
        m, v = slots["m"], slots["v"]
        tmp = g - m
        tmp *= t(1 - self.beta_1)
        m += tmp
        np.square(g, out=tmp)
        tmp -= v
        tmp *= t(1 - self.beta_2)
        v += tmp
        self._update(value, m, v, self._alpha(t, step))

    def _alpha(self, t: Any, step: int) -> Any:
        lr, t_step = t(self.learning_rate), t(step)
        b1p, b2p = np.power(t(self.beta_1), t_step), np.power(t(self.beta_2), t_step)
        return lr * np.sqrt(t(1) - b2p) / (t(1) - b1p)

    def _update(self, value: np.ndarray, m: np.ndarray, v: np.ndarray, alpha: Any) -> None:
        den = np.sqrt(v)
        den += value.dtype.type(self.epsilon)
        tmp = m * alpha
        tmp /= den
        value -= tmp

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon}


class Adagrad(HostOptimizer):
    """``keras.optimizers.Adagrad``: ``acc += g^2; var -= lr * g / sqrt(acc + epsilon)``
    (``epsilon_outside``: ``/ (sqrt(acc) + epsilon)``, tf_keras's legacy Adagrad)."""

    name = "adagrad"
    slots = ("accumulator",)

    def __init__(self, learning_rate: float = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, sparse: str = "keras", epsilon_outside: bool = False) -> None:
        super().__init__(learning_rate, sparse)
        self.initial_accumulator_value = _number("initial_accumulator_value", initial_accumulator_value)
        self.epsilon = _number("epsilon", epsilon)
        self.epsilon_outside = _flag("epsilon_outside", epsilon_outside)

    def init_slots(self, value: np.ndarray) -> dict[str, np.ndarray]:
        return {"accumulator": np.full_like(value, self.initial_accumulator_value)}

    def _rows_exact(self) -> bool:
        return True

    def _dense(self, value: np.ndarray, slots: Mapping[str, np.ndarray], g: np.ndarray, step: int) -> None:
        t = value.dtype.type
        acc = slots["accumulator"]
        acc += np.square(g)
        den = _root(acc, t(self.epsilon), self.epsilon_outside)
        num = g * t(self.learning_rate)
        num /= den
        value -= num

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "initial_accumulator_value": self.initial_accumulator_value,
                "epsilon": self.epsilon, "epsilon_outside": self.epsilon_outside}


class RMSprop(HostOptimizer):
    """``keras.optimizers.RMSprop``: ``v = rho * v + (1 - rho) * g^2``; centered, also
    ``a = rho * a + (1 - rho) * g`` and ``den = v - a^2 + epsilon``, else ``den = v +
    epsilon``; ``inc = lr * g / sqrt(den)``; with momentum ``m = momentum * m + inc; var -=
    m``, else ``var -= inc``. ``epsilon_outside``: ``sqrt(den - epsilon) + epsilon``
    instead (tf_keras's legacy RMSprop without momentum)."""

    name = "rmsprop"

    def __init__(self, learning_rate: float = 0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, centered: bool = False, sparse: str = "keras",
                 epsilon_outside: bool = False) -> None:
        super().__init__(learning_rate, sparse)
        self.rho = _number("rho", rho, high=1.0)
        self.momentum = _number("momentum", momentum, high=1.0)
        self.epsilon = _number("epsilon", epsilon)
        self.centered = _flag("centered", centered)
        self.epsilon_outside = _flag("epsilon_outside", epsilon_outside)
        self.slots = ("velocity",) + (("momentum",) if self.momentum else ()) + (("average_gradient",)
                                                                                 if centered else ())

    def _dense(self, value: np.ndarray, slots: Mapping[str, np.ndarray], g: np.ndarray, step: int) -> None:
        t = value.dtype.type
        rho, v = t(self.rho), slots["velocity"]
        v *= rho
        v += np.square(g) * t(1 - self.rho)
        if self.centered:
            a = slots["average_gradient"]
            a *= rho
            a += g * t(1 - self.rho)
            den = _root(v - np.square(a), t(self.epsilon), self.epsilon_outside)
        else:
            den = _root(v, t(self.epsilon), self.epsilon_outside)
        inc = g * t(self.learning_rate)
        inc /= den
        if self.momentum:
            m = slots["momentum"]
            m *= t(self.momentum)
            m += inc
            value -= m
        else:
            value -= inc

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "rho": self.rho, "momentum": self.momentum, "epsilon": self.epsilon,
                "centered": self.centered, "epsilon_outside": self.epsilon_outside}


_BY_NAME: dict[str, type[HostOptimizer]] = {"sgd": SGD, "adam": Adam, "adagrad": Adagrad, "rmsprop": RMSprop}


def from_config(config: Mapping[str, Any]) -> HostOptimizer:
    """The optimizer ``get_config()`` described (``{"name": "adam", ...}``)."""
    if not isinstance(config, Mapping) or config.get("name") not in _BY_NAME:
        name = config.get("name") if isinstance(config, Mapping) else config
        raise ConfigError(f"`optimizer` must name one of {sorted(_BY_NAME)}. Received: {name!r}")
    kwargs = {k: v for k, v in config.items() if k != "name"}
    try:
        return _BY_NAME[config["name"]](**kwargs)
    except TypeError as e:
        raise ConfigError(f"`optimizer` {config['name']!r} got an unknown setting ({e}). Received: {dict(config)!r}") from None


# Keras settings this module implements only at their defaults.
_KERAS_DEFAULTS = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
                   "use_ema": False, "amsgrad": False, "loss_scale_factor": None, "gradient_accumulation_steps": None,
                   "decay": 0.0}  # tf_keras's legacy optimizers: a learning-rate decay
_KERAS_KEYS = {"sgd": ("learning_rate", "momentum", "nesterov"),
               "adam": ("learning_rate", "beta_1", "beta_2", "epsilon"),
               "adagrad": ("learning_rate", "initial_accumulator_value", "epsilon"),
               "rmsprop": ("learning_rate", "rho", "momentum", "epsilon", "centered")}


def from_keras(optimizer: Any, *, sparse: str = "keras") -> HostOptimizer:
    """The host optimizer equal to a Keras 3 or tf_keras SGD, Adam, Adagrad or RMSprop
    (constant learning rate), legacy tf_keras ones with their kernels' arithmetic (see
    below)."""
    config = optimizer.get_config()
    name = type(optimizer).__name__.lower()
    if name not in _KERAS_KEYS:
        raise ConfigError(f"`optimizer` must be a keras.optimizers SGD, Adam, Adagrad or RMSprop. Received: "
                          f"{optimizer!r}")
    for key, default in _KERAS_DEFAULTS.items():
        if config.get(key, default) not in (default, 0, 0.0) or (key == "amsgrad" and config.get(key)):
            raise ConfigError(f"`optimizer` setting {key}={config[key]!r} is not supported on parameter servers "
                              f"(only {default!r}). Received: {type(optimizer).__name__}")
    if not isinstance(config.get("learning_rate"), (int, float, np.floating)) or isinstance(config["learning_rate"], bool):
        raise ConfigError("`optimizer` must have a constant learning rate on parameter servers. "
                          f"Received: learning_rate={config.get('learning_rate')!r}")
    settings: dict[str, Any] = {k: config[k] for k in _KERAS_KEYS[name]}
    if ".optimizers.legacy." in type(optimizer).__module__:
        # tf_keras's legacy (OptimizerV2) kernels: Adagrad, and RMSprop without momentum,
        # add epsilon after the square root; SGD and RMSprop with momentum update only an
        # embedding's looked-up rows, which is what "lazy" does.
        if name == "adagrad" or (name == "rmsprop" and not settings["momentum"]):
            settings["epsilon_outside"] = True
        if sparse == "keras" and name in ("sgd", "rmsprop") and settings["momentum"]:
            sparse = "lazy"
    return from_config({"name": name, "sparse": sparse, **settings})
