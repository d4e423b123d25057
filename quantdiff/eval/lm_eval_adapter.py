"""lm-evaluation-harness adapter: run any `lm_eval` task on a quantdiff model with a quantization applied.

Optional extra `eval` (`pip install quantdiff[eval]`); import this module only when lm_eval is wanted.

    import lm_eval
    from quantdiff.eval.lm_eval_adapter import QuantdiffLM
    lm = QuantdiffLM(model, tokenizer, parse_config("absmax", 4, "logits"))
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Log-likelihoods are computed by quantdiff's own scorer (the one the `choice` task uses), so `choice` and
the harness give the same acc/acc_norm on the same HellaSwag-format data. The quantization is applied
around every batch of requests and removed afterwards, leaving the model as it was between calls.
"""

from __future__ import annotations

from torch import nn

from quantdiff.core.errors import ConfigError
from quantdiff.quant.sites import QuantConfig, quantized
from quantdiff.eval.tasks.choice import encode, prefix_token_id
from quantdiff.eval.tasks.retrieval import greedy_generate
from quantdiff.eval.scoring import max_positions, score_targets

try:
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
except ImportError:  # pragma: no cover - depends on the environment
    raise ConfigError("the lm-evaluation-harness adapter needs lm_eval: pip install 'quantdiff[eval]'") from None

DEFAULT_MAX_LENGTH = 2048  # for models whose config states no maximum position


class QuantdiffLM(TemplateLM):
    """A `lm_eval` model over an in-memory quantdiff model; `config` None = unquantized."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        config: QuantConfig | None = None,
        batch_size: int = 8,
        max_gen_toks: int = 32,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return max_positions(self.model) or DEFAULT_MAX_LENGTH

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens:
            return list(self.tokenizer.encode(string, add_special_tokens=True))
        return encode(self.tokenizer, string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) strings or None, context ids, continuation ids)."""
        with quantized(self.model, self.config):
            scores = score_targets(self.model, [(ctx, cont) for _, ctx, cont in requests], self.batch_size)
        results = [(s.logprob, s.greedy) for s in scores]
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's full log-likelihood in disjoint windows of the model's length (the harness's scheme)."""
        out = []
        for (string,) in (req.args for req in requests):
            windows = [
                lm_eval_utils.make_disjoint_window(w)
                for w in lm_eval_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(logprob for logprob, _ in self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding only (sampling arguments are refused): `max_gen_toks` tokens, cut at the first stop string."""
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            gen_kwargs = dict(gen_kwargs)
            if gen_kwargs.pop("do_sample", False) or gen_kwargs.get("temperature", 0.0) not in (0, 0.0):
                raise ConfigError("QuantdiffLM decodes greedily only: use do_sample=False / temperature=0")
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else until
            n_tokens = gen_kwargs.get("max_gen_toks", self.max_gen_toks)
            context_ids = self.tok_encode(context)[-(self.max_length - n_tokens) :]
            with quantized(self.model, self.config):
                (generated,) = greedy_generate(self.model, [context_ids], n_tokens)
            text = self.tok_decode(generated)
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
