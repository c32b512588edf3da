"""Private native core of the fused CPU Adam kernel (use nvoffload.optim.kernels)."""

FLOAT32: int
BFLOAT16: int
FLOAT16: int
NONE: int
STATE_FP32: int
STATE_BF16_MOMENTS: int
STATE_BF16: int
STATE_FP8_MOMENTS: int
STATE_FP8: int
FP8_BLOCK: int

def adam_step(
    param: int,
    grad: int,
    exp_avg: int,
    exp_avg_sq: int,
    max_exp_avg_sq: int,
    moment_exponents: int,
    param_out: int,
    numel: int,
    tail_from: int,
    grad_dtype: int,
    out_dtype: int,
    state: int,
    sr_seed: int,
    first_index: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    grad_scale: float,
    maximize: bool,
) -> None: ...
def stream_probe(a: int, b: int, c: int, grad: int, out: int, numel: int, grad_dtype: int, out_dtype: int) -> None: ...
def supported_isas() -> list[str]: ...
def current_isa() -> str: ...
def set_isa(name: str) -> str: ...
def set_num_threads(num_threads: int) -> None: ...
def get_num_threads() -> int: ...
def _set_prefetch(elems: int) -> None: ...
