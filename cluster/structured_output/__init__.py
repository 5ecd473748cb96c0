"""Structured output with xgrammar: entry validation, the compile service, rank 0's matchers."""
from cluster.structured_output.compiler import (GrammarCompileService, TokenizerSource,
                                                load_hf_tokenizer, make_tokenizer_info,
                                                tokenizer_info_for)
from cluster.structured_output.matcher import GrammarState, StructuredOutputManager
from cluster.structured_output.validate import GrammarSpec, choice_ebnf, grammar_spec, validate_structured_outputs

__all__ = ["GrammarCompileService", "GrammarSpec", "GrammarState", "StructuredOutputManager",
           "TokenizerSource", "choice_ebnf", "grammar_spec", "load_hf_tokenizer", "make_tokenizer_info",
           "tokenizer_info_for", "validate_structured_outputs"]
