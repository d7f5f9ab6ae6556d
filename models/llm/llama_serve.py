"""The embedded backend's server process: llama-cpp-python's OpenAI-compatible server, with greedy
grammar-constrained sampling that checks the grammar lazily.

llama-cpp-python samples a grammar-constrained token by matching every one of the vocabulary's
tokens against the grammar (262,144 for Gemma 3), at every step. With greedy decoding the answer is
the best-scoring token the grammar allows, so it is enough to check the best-scoring token alone and
to fall back to the full match only when the grammar rejects it (llama.cpp's own `common` sampler
does the same). The tokens produced are identical (tests/test_local_llm.py checks it on the packaged
model); Direct Forecast on four demo patients took 383 s instead of 519 s (docs/llm.md).

Every other sampling configuration (a temperature, a logits processor, no grammar) goes through
llama-cpp-python unchanged.

The grammar holds a reply to the bounds of the schema's integers too: llama-cpp-python's converter
ignores `minimum` and `maximum`, so each bounded integer reaches it as the enumeration of its values.

Run as `python -m models.llm.llama_serve <llama_cpp.server arguments>`.
"""

from __future__ import annotations

import ctypes
import json

import llama_cpp
import llama_cpp.llama_grammar
import numpy as np

# The sampler chain llama-cpp-python builds for temperature 0 with a grammar and no logits processor.
LAZY_CHAIN = (b"penalties", b"grammar", b"greedy")
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def _token_array(data: np.ndarray) -> llama_cpp.llama_token_data_array:
    pointer = data.ctypes.data_as(llama_cpp.llama_token_data_p)
    return llama_cpp.llama_token_data_array(data=pointer, size=len(data), selected=-1, sorted=False)


def _selected(array: llama_cpp.llama_token_data_array, buffer: np.ndarray) -> np.ndarray:
    """A copy of the array's best-scoring entry (the first on a tie, as llama.cpp's greedy sampler).

    Samplers work in place, but may move the array's data pointer within `buffer` (which must own it).
    """
    view = np.ctypeslib.as_array(array.data, shape=(array.size,)).view(TOKEN_DATA)
    assert buffer.ctypes.data <= view.ctypes.data < buffer.ctypes.data + buffer.nbytes
    return view[[int(np.argmax(view["logit"]))]].copy()


class LazyGrammarLlama(llama_cpp.Llama):
    """`llama_cpp.Llama` whose greedy grammar-constrained sampling checks the grammar on the best token first."""

    def sample(self, *args, idx: int | None = None, **kwargs) -> int:
        chain = self._sampler.sampler if self._sampler is not None else None
        if chain is None or self._chain_names(chain) != LAZY_CHAIN:
            return super().sample(*args, idx=idx, **kwargs)
        penalties, grammar = (llama_cpp.llama_sampler_chain_get(chain, i) for i in range(2))
        ridx = idx - self.n_tokens if idx is not None else -1
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx.ctx, ridx), shape=(self._n_vocab,))
        # `buffer` owns the memory the C arrays point to: it must outlive every call below.
        buffer = np.empty(self._n_vocab, dtype=TOKEN_DATA)
        buffer["id"] = np.arange(self._n_vocab, dtype=np.int32)
        buffer["logit"] = logits
        buffer["p"] = 0.0
        full = _token_array(buffer)
        llama_cpp.llama_sampler_apply(penalties, ctypes.byref(full))
        best = _selected(full, buffer)
        alone = _token_array(best)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(alone))
        if np.isfinite(best["logit"][0]):
            token = int(best["id"][0])
        else:  # the grammar rejects the best token: match the whole vocabulary, as the chain would
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(full))
            token = int(_selected(full, buffer)["id"][0])
        llama_cpp.llama_sampler_accept(chain, token)  # advances the penalties' history and the grammar
        return token

    @staticmethod
    def _chain_names(chain) -> tuple[bytes, ...]:
        return tuple(llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(chain, i))
                     for i in range(llama_cpp.llama_sampler_chain_n(chain)))


# Widest bounded integer turned into an enumeration (a grammar alternative per value); wider ones stay unbounded.
MAX_ENUMERATED = 1000
# Keywords whose values are data, not schemas.
DATA_KEYWORDS = {"enum", "const", "default", "examples"}
STOCK_JSON_SCHEMA_TO_GBNF = llama_cpp.llama_grammar.json_schema_to_gbnf


def enumerate_bounded_integers(schema):
    """`schema` with each integer bounded by `minimum` and `maximum` replaced by the enumeration of its values.

    llama-cpp-python's schema converter (0.3.36) ignores both bounds, so the grammar let Direct Forecast's
    0-100 confidences run up to 125 (MIMIC-III demo), a reply that only validation then refused; it does
    turn an enumeration into a grammar.

    >>> enumerate_bounded_integers({"type": "integer", "minimum": 1, "maximum": 3, "description": "x"})
    {'description': 'x', 'enum': [1, 2, 3]}
    """
    if isinstance(schema, list):
        return [enumerate_bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: value if key in DATA_KEYWORDS else enumerate_bounded_integers(value)
              for key, value in schema.items()}
    low, high = schema.get("minimum"), schema.get("maximum")
    if (schema.get("type") == "integer" and type(low) is int and type(high) is int
            and 0 <= high - low <= MAX_ENUMERATED):
        return {**{key: value for key, value in schema.items() if key not in ("type", "minimum", "maximum")},
                "enum": list(range(low, high + 1))}
    return schema


def bounded_json_schema_to_gbnf(schema: str, prop_order: list[str] | None = None) -> str:
    """llama-cpp-python's `json_schema_to_gbnf`, with the schema's bounded integers enumerated first."""
    return STOCK_JSON_SCHEMA_TO_GBNF(json.dumps(enumerate_bounded_integers(json.loads(schema))), prop_order)


def main() -> None:
    from llama_cpp.server.__main__ import main as serve

    llama_cpp.Llama = LazyGrammarLlama  # the server builds its model through this name
    # `LlamaGrammar.from_json_schema`, which the server calls for a reply's schema, looks this name up.
    llama_cpp.llama_grammar.json_schema_to_gbnf = bounded_json_schema_to_gbnf
    serve()


if __name__ == "__main__":
    main()
