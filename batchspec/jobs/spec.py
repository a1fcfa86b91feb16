"""JobSpec: what a job runs (inputs, model pair, sampling, output dir), built from CLI flags,
a YAML file (`--config job.yaml`), or both (flags win), through one validation path.

The spec travels as JSON (Redis job record, `_job.json`) and is rebuilt on the worker; the
EngineConfig is derived from it in one place, `engine_config`."""
from __future__ import annotations

import dataclasses
import datetime as dt
import os
import secrets
from dataclasses import dataclass, field

import yaml

from batchspec.config import EngineConfig, draft_sources
from batchspec.contract import DEFAULT_NUM_SPECULATIVE_TOKENS, SUFFIX
from batchspec.sampling import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens")
# Keys a job YAML may carry for the scheduler; not part of what a job runs.
SCHEDULE_KEYS = ("schedule", "timezone")
# parquet: OUT/{outputs,acceptance,errors}/; openai: those plus the OpenAI Batch output and
# error files (jobs/openai_batch.py), written when the job finalizes.
OUTPUT_FORMATS = ("parquet", "openai")


_SCALAR_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}
_SCALAR_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false",
                 "str": "text"}


@dataclass
class JobSpec:
    inputs: list[str]
    output: str
    model: str | None = None          # None: the bundled demo models (target + drafts)
    drafts: dict[str, str] = field(default_factory=dict)
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    confidence_threshold: float = 0.0
    temperature: float = 0.0          # batch jobs default to greedy: reproducible outputs
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int = 0
    device: str = "auto"
    tensor_parallel_size: int | None = None  # None: one rank per device listed in `device`
    dtype: str = "auto"
    num_threads: int | None = None    # CPU intra-op threads; None: EngineConfig's default
    shard_size: int = 1000
    template: str | None = None       # e.g. "Question: {question}\nContext: {context}"
    chat: bool = False                # wrap prompts as a user message, apply chat template
    min_acceptance: float | None = None
    max_spec_temperature: float | None = None
    # per step, each row's draft length by expected tokens/s from costs measured at start-up
    # (never far below plain decoding at a job's batch sizes, where a fixed k loses)
    adaptive_k: bool = True
    # drafts score only their draft_vocab.json's tokens; None: for rows sampled greedily
    # (sampled, the target often picks a token outside the list: docs/benchmarks.md)
    draft_vocab: bool | None = None
    prefix_caching: bool = True       # share the KV of identical prompt prefixes
    max_attempts: int = 3             # deliveries of a shard before it is marked failed
    output_format: str = "parquet"    # openai: also OUT/openai/{output,errors}.jsonl
    # output directory of an earlier run (e.g. "out/{yesterday}" in a scheduled job) whose
    # outputs seed the job-wide suffix tries; needs a suffix draft
    suffix_seed: str | None = None
    name: str | None = None
    job_id: str | None = None

    def __post_init__(self):
        self._check_types()
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        self.inputs = [str(p) for p in self.inputs or []]
        if not self.inputs:
            raise ValueError("a job needs at least one input (Parquet path, glob or URL)")
        if not self.output:
            raise ValueError("a job needs an output directory (-o/--output)")
        if "://" not in self.output:  # workers may run in another directory
            self.output = os.path.abspath(self.output)
        self.drafts = parse_drafts(self.drafts)
        if self.model is None:
            self._use_demo_models()
        # Absolute model paths: workers and resumed runs may start in another directory.
        self.model = _absolute(self.model)
        self.drafts = {d: _absolute(p) for d, p in self.drafts.items()}
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be one of {list(OUTPUT_FORMATS)}, "
                             f"got {self.output_format!r}")
        if self.suffix_seed is not None:
            if not any(SUFFIX in draft_sources(v) for v in self.drafts.values()):
                raise ValueError("suffix_seed seeds suffix drafts, and no domain drafts with "
                                 "them: add --draft DOMAIN=suffix or DOMAIN=DIR+suffix")
            if "://" not in self.suffix_seed:
                self.suffix_seed = os.path.abspath(self.suffix_seed)
        if self.template is not None and not self.template.strip():
            raise ValueError("template is empty")
        self.sampling_params()
        # EngineConfig owns the checks of model paths, k, tau, dtype, fallback options;
        # device "cpu" here keeps torch out of processes that only submit.
        ranks = self.tensor_parallel_size
        ranks = len(self.device.split(",")) if ranks is None else ranks
        if ranks < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {ranks}")
        self.engine_config(device=",".join(["cpu"] * ranks))

    def _check_types(self):
        """Each scalar setting has its declared type (a job YAML may hold anything): an int
        where an int is declared (not a bool), a number where a float is, true/false where a
        bool is, text where a str is; null only where the setting may be unset."""
        for f in dataclasses.fields(self):
            kinds = [k.strip() for k in f.type.split("|")]
            value = getattr(self, f.name)
            if value is None and "None" in kinds:
                continue
            wanted = [k for k in kinds if k != "None"]
            if not all(k in _SCALAR_CHECKS for k in wanted):      # lists and mappings
                continue
            if not any(_SCALAR_CHECKS[k](value) for k in wanted):
                what = " or ".join(_SCALAR_NAMES[k] for k in wanted)
                unset = " (or null)" if "None" in kinds else ""
                raise ValueError(f"{f.name} must be {what}{unset}, got {value!r}")

    def _use_demo_models(self):
        try:
            from batchspec.demo import demo_models
        except ImportError as e:
            raise ValueError("no --model given and the bundled demo models are not "
                             "installed; pass --model PATH") from e
        demo = demo_models()
        self.model = demo["target"]
        if not self.drafts:
            domains = {"default": "draft", "code": "draft-code", "docs": "draft-docs"}
            self.drafts = {d: demo[k] for d, k in domains.items() if demo.get(k)}

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_fields())

    def sampling_fields(self) -> dict:
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    def engine_config(self, device: str | None = None) -> EngineConfig:
        """The EngineConfig; `device`: a worker's own device(s), which override the job's (a
        list of devices sets the tensor-parallel ranks too)."""
        tp = None if device and "," in device else self.tensor_parallel_size
        extra = {k: v for k, v in (("min_acceptance", self.min_acceptance),
                                   ("max_spec_temperature", self.max_spec_temperature),
                                   ("num_threads", self.num_threads))
                 if v is not None}
        return EngineConfig(model=self.model, drafts=dict(self.drafts),
                            num_speculative_tokens=self.num_speculative_tokens,
                            confidence_threshold=self.confidence_threshold,
                            device=device or self.device, dtype=self.dtype, seed=self.seed,
                            adaptive_k=self.adaptive_k, draft_vocab=self.draft_vocab,
                            tensor_parallel_size=tp,
                            enable_prefix_caching=self.prefix_caching, **extra)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> JobSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown job setting(s) {unknown}; valid: {sorted(names)}")
        # (the checks say what a missing one needs, as for an empty one)
        return cls(**{"inputs": [], "output": ""} | values)

    @classmethod
    def build(cls, config: str | None = None, now: dt.datetime | None = None,
              base_dir: str | None = None, **options) -> JobSpec:
        """From an optional YAML file plus CLI options (None / empty means 'not given');
        relative paths of the YAML resolve against base_dir when given (a beat firing
        built in a worker: the directory beat ran in), else the working directory."""
        values = load_yaml(config, now) if config else {}
        if base_dir is not None:
            values = resolve_paths(values, base_dir)
        for key, value in options.items():
            if value is None or value == ():
                continue
            values[key] = list(value) if isinstance(value, tuple) else value
        return cls.from_dict(values)


def resolve_paths(values: dict, base_dir: str) -> dict:
    """A job YAML's values with its relative local paths (inputs, output, suffix_seed)
    joined to base_dir."""
    def join(p):
        return p if not isinstance(p, str) or "://" in p or os.path.isabs(p) else \
            os.path.join(base_dir, p)
    out = dict(values)
    if isinstance(out.get("inputs"), list):
        out["inputs"] = [join(p) for p in out["inputs"]]
    for key in ("output", "suffix_seed"):
        if out.get(key) is not None:
            out[key] = join(out[key])
    return out


def _absolute(path: str) -> str:
    return os.path.abspath(path) if os.path.isdir(path) else path


def parse_drafts(drafts) -> dict[str, str]:
    """{domain: path} from a dict or from 'DOMAIN=PATH' strings (PATH may be 'ngram' or
    'suffix')."""
    if isinstance(drafts, dict):
        return {str(k): str(v) for k, v in drafts.items()}
    out = {}
    for item in drafts or []:
        domain, sep, path = str(item).partition("=")
        if not sep or not domain or not path:
            raise ValueError(f"--draft takes DOMAIN=PATH (or DOMAIN=ngram, DOMAIN=suffix), got {item!r}")
        out[domain] = path
    return out


class _DaysAgo:
    """'{ago[N]}' in a path: the date N days before the firing."""

    def __init__(self, today: dt.date):
        self.today = today

    def __getitem__(self, n) -> dt.date:
        return self.today - dt.timedelta(days=int(n))


def fill_dates(text: str, now: dt.datetime) -> str:
    """'{date}', '{yesterday}', '{ago[N]}' (N days before), '{now:%Y%m%dT%H%M}' -> the
    firing time's values."""
    today = now.date()
    return text.format(date=today, yesterday=today - dt.timedelta(days=1), now=now,
                       ago=_DaysAgo(today))


def load_yaml(path: str, now: dt.datetime | None = None) -> dict:
    """A job YAML as JobSpec fields; date templates in inputs, output and suffix_seed are
    filled in."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except FileNotFoundError as e:
        raise ValueError(f"job config {path!r} does not exist") from e
    except yaml.YAMLError as e:
        raise ValueError(f"job config {path!r} is not valid YAML: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"job config {path!r} must be a mapping of settings")
    values = {str(k).replace("-", "_"): v for k, v in values.items()
              if k not in SCHEDULE_KEYS}
    now = now or dt.datetime.now(dt.UTC)
    try:
        if "inputs" in values:
            inputs = values["inputs"]
            values["inputs"] = [fill_dates(p, now) for p in
                                ([inputs] if isinstance(inputs, str) else inputs)]
        for key in ("output", "suffix_seed"):
            if values.get(key) is not None:
                values[key] = fill_dates(str(values[key]), now)
    except (KeyError, ValueError, IndexError) as e:
        raise ValueError(f"job config {path!r}: bad date template in a path: {e}") from e
    return values


def new_job_id(name: str | None = None) -> str:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{name or 'job'}-{stamp}-{secrets.token_hex(3)}"
