"""kvhub as an lm-evaluation-harness model: score a mapper's handoff on any lm-eval task.

    python -m kvhub.eval.lmeval --model kvhub \\
        --model_args mapper=SRC:DST:CALIB@v3,exact_prefix=4,exact_suffix=16 --tasks hellaswag

``kvhub-lm-eval`` is the same command.  lm-eval's own ``lm_eval`` command knows only the models it ships
and loads no plugins (0.4.13 reads no entry points), so it cannot find "kvhub" by itself; this module
registers the name and then runs lm-eval's command line unchanged.  From Python, importing this module
is enough: ``import kvhub.eval.lmeval; lm_eval.simple_evaluate(model="kvhub", model_args=...)``.

model_args (comma-separated ``key=value``):

- ``mapper``: a store reference (``SRC:DST:CALIB@v3``, ``...@production``), an artifact directory or a
  Hub repository (``owner/name@v3``), resolved by :func:`kvhub.api.from_pretrained`;
- ``condition``: ``mapped`` (default: the source prefills the context, the map turns its cache into the
  target's, the target continues: the handoff), ``own`` (the target alone, the ceiling), ``source``
  (the source alone), ``control`` (the same handoff through :func:`kvhub.core.control.control_mapper`,
  a map with no information about the context);
- ``exact_prefix``, ``exact_suffix``, ``exact_budget``, ``select``: the context tokens the target
  recomputes itself (:mod:`kvhub.serving.recompute`); 0, 0, 0.0 (map every token), as ``kvhub eval``;
- ``deshrink``: how the maps are read (``kv``, ``v`` or ``off``; :mod:`kvhub.core.deshrink`; its default);
- ``dtype`` (bfloat16, or float32 on a CPU that emulates bf16: :func:`kvhub.dtypes.default_dtype`), ``device`` (lm-eval's ``--device`` otherwise; cuda if available), ``db`` (the
  store), ``source`` / ``target`` (model specs overriding the ids the mapper records), ``max_length``
  (default: the target's max_position_embeddings), ``max_gen_toks`` (256), ``rolling_chunk`` (64).

Results name the version scored: the run (its ``--output_path`` folder and ``model_name``) is named after the
resolved ``SRC:DST:CALIB@vN`` whatever alias was typed, and the results' ``config`` carries ``mapper_ref`` and
``mapper_tensors_sha256`` (also as lm-eval's ``model_revision`` / ``model_sha``), as ``kvhub eval``'s do.

Requests:

- ``loglikelihood``: lm-eval's tokenisation (``TemplateLM``: context and continuation tokenised
  together, an empty context replaced by the eos token; no special tokens added, as ``kvhub eval``).
  Requests sharing a context are scored in one pass: the condition's cache of the context is built once
  (:func:`kvhub.eval.taskeval.condition_cache`) and the continuations run from it batched
  (:func:`kvhub.eval.taskeval.score_continuations`, the path ``kvhub eval`` scores with).
- ``loglikelihood_rolling``: the text is scored in chunks of ``rolling_chunk`` tokens; chunk i is
  predicted by the condition's model continuing a cache of every earlier token (the last
  ``max_length - rolling_chunk`` of them), so under ``mapped`` every chunk after the first is a handoff.
  The first chunk has no context to map (only the eos token), as in a real handoff.  Under ``own``
  the total equals one pass of the target over the text (up to ``max_length`` tokens).
- ``generate_until``: greedy (a request asking for sampling is refused); ``mapped`` / ``control``
  through :func:`kvhub.serving.handoff.handoff`, ``own`` / ``source`` through the model's ``generate``;
  cut at the first ``until`` string.
"""

from __future__ import annotations

import logging

import torch

from kvhub.core.deshrink import check_deshrink
from kvhub.errors import ConfigError

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the optional extra: the module still imports, and says what to install when used
    TemplateLM = None

log = logging.getLogger(__name__)
MISSING = "kvhub's lm-evaluation-harness model needs lm_eval: pip install 'kvhub[lmeval]'"

MODEL_NAME = "kvhub"
LMEVAL_CONDITIONS = ("mapped", "own", "source", "control")
CHOICES_PER_PASS = 32  # continuations of one context run in one forward pass


DEFAULTS = dict(
    mapper=None,
    condition="mapped",
    exact_prefix=0,
    exact_suffix=0,
    exact_budget=0.0,
    select="source",
    deshrink=None,
    dtype=None,  # kvhub.dtypes.default_dtype: bfloat16, or float32 on a CPU that emulates bf16
    device=None,
    db=None,
    source=None,
    target=None,
    max_length=None,
    max_gen_toks=256,
    rolling_chunk=64,
    batch_size=None,
    max_batch_size=None,
)


def check_model_args(model_args: dict) -> dict:
    """The model_args of ``--model kvhub`` (module docstring) checked and completed with the defaults, without
    loading anything; ``recompute`` holds the recompute variant.  ConfigError names what is wrong."""
    from kvhub.dtypes import dtype_name
    from kvhub.serving.recompute import Recompute

    unknown = sorted(set(model_args) - set(DEFAULTS))
    if unknown:
        raise ConfigError(
            f"unknown model_args for --model kvhub: {', '.join(unknown)}; known: "
            f"{', '.join(k for k in DEFAULTS if k not in ('batch_size', 'max_batch_size'))}"
        )
    args = {**DEFAULTS, **{k: v for k, v in model_args.items() if v is not None}}
    if not args["mapper"]:
        raise ConfigError(
            "--model kvhub needs the mapper: --model_args mapper=SRC:DST:CALIB@v3 (a store "
            "reference, an artifact directory or a Hub repository OWNER/NAME@v3)"
        )
    if args["condition"] not in LMEVAL_CONDITIONS:
        raise ConfigError(f"unknown condition {args['condition']!r}; use one of {', '.join(LMEVAL_CONDITIONS)}")
    for name in ("max_gen_toks", "rolling_chunk"):
        args[name] = _number(name, args[name], int, minimum=1)
    if args["max_length"] is not None:
        args["max_length"] = _number("max_length", args["max_length"], int, minimum=2)
    args["recompute"] = Recompute(
        _number("exact_prefix", args["exact_prefix"], int),
        _number("exact_suffix", args["exact_suffix"], int),
        _number("exact_budget", args["exact_budget"], float),
        str(args["select"]),
    )
    if args["dtype"] is None:
        from kvhub.dtypes import default_dtype

        args["dtype"], note = default_dtype(args["device"])
        if note:
            log.warning("%s", note)
    args["dtype"] = dtype_name(args["dtype"])
    args["mapper"] = str(args["mapper"])
    check_deshrink(args["deshrink"])
    return args


class KVHubLM(TemplateLM or object):
    """An lm-eval ``LM`` scoring one condition of a mapper (module docstring)."""

    def __init__(self, mapper: str | None = None, **model_args):
        if TemplateLM is None:
            raise ConfigError(MISSING)
        super().__init__()
        args = check_model_args({"mapper": mapper, **model_args})
        self.condition, self.recompute = args["condition"], args["recompute"]
        self.batch_size = args["batch_size"]  # accepted for lm-eval's sake: requests are batched by shared context
        self._load(
            args["mapper"],
            dtype=args["dtype"],
            device=args["device"],
            db=args["db"],
            source=args["source"],
            target=args["target"],
            deshrink=args["deshrink"],
        )
        self._max_length = args["max_length"] or int(getattr(self.target.config, "max_position_embeddings", 2048))
        self.max_gen_toks, self.rolling_chunk = args["max_gen_toks"], args["rolling_chunk"]
        if self.rolling_chunk >= self._max_length:
            raise ConfigError(f"rolling_chunk ({self.rolling_chunk}) must be below max_length ({self._max_length})")

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "KVHubLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "KVHubLM":
        """model_args win over lm-eval's own options (``--device`` defaults to cuda:0, which a machine
        without CUDA does not have: that default then falls back to the CPU)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if "device" in extra and str(extra["device"]).startswith("cuda") and not torch.cuda.is_available():
            log.warning("lm-eval's device %s is not available here: using the CPU", extra["device"])
            extra["device"] = "cpu"
        return cls(**arg_dict, **extra)

    def _load(self, ref: str, *, dtype, device, db, source, target, deshrink=None) -> None:
        from kvhub.api import from_pretrained
        from kvhub.models.loading import load_model
        from kvhub.serving.handoff import check_models

        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={device} but CUDA is not available here; use device=cpu")
        self.dtype_name = dtype
        self.mapper = from_pretrained(ref, db=db, device=device, dtype=dtype, deshrink=deshrink)
        self.source, self.tokenizer, _ = load_model(
            source or self.mapper.source["model_id"], device=device, dtype=self.dtype_name
        )
        self.target, _, _ = load_model(target or self.mapper.target["model_id"], device=device, dtype=self.dtype_name)
        if self.tokenizer is None:
            raise ConfigError(f"{source or self.mapper.source['model_id']} has no tokenizer files; lm-eval needs one")
        self._device = next(self.target.parameters()).device
        self.mapper.to(device=self._device)
        check_models(self.mapper, self.source, self.target, tokenizer=self.tokenizer)
        self.ref = self.mapper.ref or ref
        self.tensors_sha256 = (self.mapper.metadata.get("tensors") or {}).get("sha256")
        _RESOLVED[ref] = self.ref  # the run is named after the version scored (_name_runs_after_the_mapper)
        if self.condition == "control":
            from kvhub.core.control import control_mapper

            self.mapper = control_mapper(self.mapper)

    def get_model_info(self) -> dict:
        """What lm-eval adds to a results file's ``config`` (its HF model: ``model_revision``, ``model_sha``): the
        mapper version scored, as resolved (``SRC:DST:CALIB@v3`` for ``...@production``), its tensors' sha256,
        the condition and the dtype; ``model_revision`` / ``model_sha`` carry the same two for tools that read those."""
        return {
            "mapper_ref": self.ref,
            "mapper_tensors_sha256": self.tensors_sha256,
            "condition": self.condition,
            "model_revision": self.ref,
            "model_sha": self.tensors_sha256,
            "model_dtype": self.dtype_name,
        }

    # ---- what lm-eval asks of a TemplateLM --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- scoring ----------------------------------------------------------------------------------
    def _score(self, context: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """One condition's (log-likelihood, greedy) of each continuation after ``context`` (token ids)."""
        from kvhub.eval.taskeval import score_continuations

        longest = max(len(c) for c in continuations)
        if longest > self.max_length:
            raise ConfigError(
                f"a continuation of {longest} tokens exceeds max_length={self.max_length}; raise "
                "max_length in --model_args if the models take longer inputs"
            )
        context = context[-(self.max_length + 1 - longest) :]  # the models see at most max_length tokens
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        condition = {"own": "own", "source": "source"}.get(self.condition, "mapped")  # control: mapped, control map
        return score_continuations(
            context,
            continuations,
            condition=condition,
            source=self.source,
            target=self.target,
            mapper=self.mapper,
            recompute=self.recompute,
            tokenizer=self.tokenizer,
            pad_id=pad,
        )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) strings or None, context ids, continuation ids), in order."""
        from tqdm import tqdm

        groups: dict[tuple[int, ...], list[int]] = {}
        for index, (_, context, _) in enumerate(requests):
            groups.setdefault(tuple(context), []).append(index)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for context, indices in tqdm(groups.items(), disable=disable_tqdm, desc=f"kvhub {self.condition}"):
            for start in range(0, len(indices), CHOICES_PER_PASS):
                chunk = indices[start : start + CHOICES_PER_PASS]
                scores = self._score(list(context), [requests[i][2] for i in chunk])
                for i, score in zip(chunk, scores):
                    results[i] = score
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from tqdm import tqdm

        totals = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc=f"kvhub {self.condition} rolling"):
            chunks = self.rolling_chunks(self.tok_encode(text))
            total = sum(
                score for score, _ in self._loglikelihood_tokens([(None, c, p) for c, p in chunks], disable_tqdm=True)
            )
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    def rolling_chunks(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context ids, predicted ids) per chunk of ``rolling_chunk`` tokens: each token predicted once,
        after the eos token and every earlier token (at most max_length tokens in all)."""
        full = [self.prefix_token_id] + tokens
        history = self.max_length + 1 - self.rolling_chunk
        return [
            (full[max(0, start + 1 - history) : start + 1], tokens[start : start + self.rolling_chunk])
            for start in range(0, len(tokens), self.rolling_chunk)
        ]

    # ---- generation -------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        from tqdm import tqdm

        out = []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for context, gen_kwargs in tqdm(
            [r.args for r in requests], disable=disable_tqdm, desc=f"kvhub {self.condition} generate"
        ):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ConfigError(
                    "kvhub's lm-eval model decodes greedily; run the task with --gen_kwargs do_sample=False"
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            max_new = int(kwargs["max_gen_toks"])
            if max_new >= self.max_length:
                raise ConfigError(
                    f"max_gen_toks={max_new} leaves no room for a context within max_length={self.max_length}"
                )
            ids = self.tok_encode(context)[-(self.max_length - max_new) :] or [self.prefix_token_id]
            text = self.tok_decode(self._generate(ids, max_new, until))
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    @torch.no_grad()
    def _generate(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        """Greedy continuation ids of ``ids`` under the condition, stopped once an ``until`` string appears."""
        from transformers import StoppingCriteriaList

        from kvhub.serving.handoff import handoff

        prompt = torch.tensor([ids], device=self.device)
        kwargs = dict(
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=self.eot_token_id,
            pad_token_id=self.eot_token_id,
            stopping_criteria=StoppingCriteriaList([_StopStrings(self.tokenizer, until, len(ids))]),
        )
        if self.condition in ("mapped", "control") and len(ids) >= 2:
            output = handoff(
                self.mapper,
                self.source,
                self.target,
                prompt,
                recompute=self.recompute,
                tokenizer=self.tokenizer if self.recompute.selective else None,
                **kwargs,
            )  # checked at load
        else:  # own, source, or a one-token prompt (nothing to map)
            model = self.source if self.condition == "source" else self.target
            output = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        return output[0, len(ids) :].tolist()


def _number(name: str, value, kind, *, minimum=0):
    """``value`` (as lm-eval parsed it from model_args) as an int or float >= minimum, else a ConfigError."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum or (kind is int and number != float(value)):
        raise ConfigError(
            f"model_args {name}={value!r}: expected a{'n integer' if kind is int else ' number'} >= {minimum}"
        )
    return number


class _StopStrings:
    """A transformers stopping criterion: stop once the decoded new text contains a stop string."""

    def __init__(self, tokenizer, stops: list[str], start: int):
        self.tokenizer, self.stops, self.start = tokenizer, [s for s in stops if s], start

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.start :], skip_special_tokens=False)
        done = any(stop in text for stop in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def register() -> None:
    """Make ``kvhub`` a model name of lm-eval in this process (idempotent), and name its runs after the mapper.

    The name points at ``kvhub.eval.lmeval:KVHubLM`` lazily, so running this file as ``__main__`` does
    not register a second copy of the class.
    """
    if TemplateLM is None:
        raise ConfigError(MISSING)
    import lm_eval.models  # noqa: F401  (its built-in names first: lm-eval only imports them into an empty registry)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="kvhub.eval.lmeval:KVHubLM")
    _name_runs_after_the_mapper()


_RESOLVED: dict[str, str] = {}  # mapper= as typed -> the version a KVHubLM of this process resolved it to


def _name_runs_after_the_mapper() -> None:
    """lm-eval names a run (its ``--output_path`` folder, the results' ``model_name``) after ``pretrained=`` and
    a few other keys, else a random word; a kvhub run names its mapper with ``mapper=``, so that key is read
    first, as the version it resolved to (lm-eval builds the model before it names the run): the folder is
    then ``<output_path>/<SRC:DST:CALIB@vN, sanitized>/``, one per version, whatever alias was typed.
    lm-eval has no hook for this: its name reader is wrapped, once, and other models' arguments go through
    it unchanged."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    original = GeneralConfigTracker._get_model_name
    if getattr(original, "kvhub_mapper_aware", False):
        return

    def model_name(model_args):
        mapper = _mapper_arg(model_args)
        return _RESOLVED.get(mapper, mapper) if mapper else original(model_args)

    model_name.kvhub_mapper_aware = True
    GeneralConfigTracker._get_model_name = staticmethod(model_name)


def _mapper_arg(model_args) -> str | None:
    """The ``mapper`` of model_args given as lm-eval passes them (a dict, or ``key=value,...`` text)."""
    if isinstance(model_args, dict):
        return str(model_args["mapper"]) if model_args.get("mapper") else None
    if isinstance(model_args, str):
        for part in model_args.split(","):
            key, _, value = part.partition("=")
            if key.strip() == "mapper" and value.strip():
                return value.strip()
    return None


def help_preface() -> str:
    """What ``kvhub-lm-eval -h`` says before lm-eval's own help: the kvhub model and its model_args."""
    names = [k for k in DEFAULTS if k not in ("batch_size", "max_batch_size")]
    return (
        "kvhub-lm-eval: lm-eval's command line with one more model, --model kvhub: the target model scored "
        "from a kvhub mapper's mapped cache.\n"
        f"  --model_args mapper=REF[,KEY=VALUE...]   keys: {', '.join(names)}\n"
        f"  condition: {' | '.join(LMEVAL_CONDITIONS)} (default mapped)\n"
        "  e.g. kvhub-lm-eval --model kvhub --model_args mapper=src:dst:legal-docs@v1 --tasks hellaswag "
        "--limit 100\n"
        "  (docs/guide.md, 'Any lm-eval task'; lm-eval's own help follows)\n"
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m kvhub.eval.lmeval`` / ``kvhub-lm-eval``: lm-eval's command line (what its ``lm_eval``
    command runs) with ``--model kvhub`` known and its model_args checked first; a kvhub error ends it
    with its message and exit code instead of a traceback."""
    import sys

    from kvhub.errors import KVHubError

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(help_preface())  # lm-eval's help follows, which knows nothing of --model kvhub
    try:
        register()
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging

        setup_logging()
        parser = HarnessCLI()
        args = parser.parse_args()
        if getattr(args, "model", None) == MODEL_NAME and isinstance(getattr(args, "model_args", None), dict):
            check_model_args(args.model_args)  # before lm-eval indexes its tasks and the models load
        parser.execute(args)
    except KVHubError as exc:
        print(f"kvhub: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if TemplateLM is not None:
    register()

if __name__ == "__main__":
    main()
