"""Constrained decoding: SGLang's ``json_schema``, ``regex`` and ``ebnf`` sampling keys, with xgrammar
(SGLang's default grammar backend), as a per-request constraint on the logits.

`Grammars` holds one tokenizer's grammar compiler and a small LRU of the grammars compiled for it, keyed
by (kind, source): a group of n samples, or a run of requests with one schema, compiles once. Its
`Grammars.constraint` gives each sample its own `Grammar` — the matcher that walks the grammar token by
token: `Grammar.mask` sets the logits of every token the grammar does not allow next to -inf,
`Grammar.accept` advances it by the sampled token, `Grammar.done` says it has ended.

SGLang's semantics: at most one of the three keys per request; ``json_schema`` is a JSON Schema as a
string, or ``"$$ANY$$"`` for any JSON object or array (xgrammar's built-in JSON grammar); ``regex`` a regular
expression the whole output matches; ``ebnf`` a GBNF grammar whose start rule is ``root``. A grammar
ends only on one of the model's stop tokens (the EOS), which ends the request (finish reason ``stop``,
``matched`` that token). A schema, expression or grammar that does not compile is `InvalidSampling`
``bad_grammar`` naming the field.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import Any, Literal

import torch
import xgrammar as xgr

from .errors import InvalidSampling
from .protocol import SamplingParams

__all__ = ["ANY_JSON", "GRAMMAR_KINDS", "Grammar", "GrammarKind", "Grammars"]

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf")
ANY_JSON = "$$ANY$$"
"""SGLang's ``json_schema`` value for any JSON object or array, without a schema."""

DEFAULT_CACHE_SIZE = 64

# xgrammar's messages start with the C++ log prefix ("[15:46:05] /project/cpp/regex_converter.cc:94: ");
# the caller needs only what follows it.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class Grammar:
    """One sample's walk through a compiled grammar; used from one thread (the engine's scheduler)."""

    __slots__ = ("_bitmask", "_matcher", "_vocab_size")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def done(self) -> bool:
        """Whether the grammar has accepted its end (a stop token): nothing more may be generated."""
        return bool(self._matcher.is_terminated())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """1-D logits with every token the grammar does not allow next at -inf, in place; returns them."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask if self._bitmask.device == logits.device else self._bitmask.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(self._vocab_size, logits.numel()))
        if logits.numel() > self._vocab_size:  # ids past the grammar's vocabulary are never text
            logits[self._vocab_size :] = float("-inf")
        return logits

    def accept(self, token: int) -> None:
        """Advance by the sampled token; a token `mask` did not allow is the engine's bug, a RuntimeError."""
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar does not accept token {token} here")


class Grammars:
    """One tokenizer's grammar compiler and its compiled grammars (an LRU of ``cache_size``); thread-safe.

    ``vocab_size`` is the model's logits width, which may exceed the tokenizer's vocabulary (padded
    embeddings); ``stop_token_ids`` are the tokens that end a grammar (the model's EOS ids). The
    tokenizer's tables are built on the first grammar, so an engine that never sees one pays nothing."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        stop_token_ids: Collection[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[tuple[GrammarKind, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, params: SamplingParams) -> Grammar | None:
        """A fresh matcher for the grammar ``params`` name, or None when they name none."""
        grammar = params.grammar
        if grammar is None:
            return None
        return Grammar(self.compile(*grammar), self.vocab_size)

    def compile(self, kind: GrammarKind, source: str) -> xgr.CompiledGrammar:
        """The compiled grammar (from the cache when there); raises `InvalidSampling` ``bad_grammar``."""
        key = (kind, source)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
            compiler = self._compiler_locked()
        # Compiling outside the lock: a large schema over a large vocabulary takes a while, and other
        # requests' grammars need not wait for it (two threads may compile one key; the last one stays).
        try:
            if kind == "json_schema":
                if source == ANY_JSON:
                    compiled = compiler.compile_builtin_json_grammar()
                else:
                    compiled = compiler.compile_json_schema(source)
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            else:
                compiled = compiler.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as error:
            message = _LOG_PREFIX.sub("", str(error)).strip()
            raise InvalidSampling(
                f"{kind} does not compile: {message}", code="bad_grammar", field=f"sampling_params.{kind}"
            ) from None
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    @property
    def cached(self) -> int:
        """Compiled grammars held now."""
        return len(self._compiled)

    def _compiler_locked(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
            )
            # xgrammar's own cache is unbounded by default; the LRU above bounds what is kept.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler
