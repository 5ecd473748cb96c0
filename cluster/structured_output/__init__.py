"""Structured output with xgrammar: entry validation, the compile service, rank 0's matchers."""
from cluster.structured_output.compiler import (GrammarCompileService, make_tokenizer_info, tokenizer_info_for,
                                                tokenizer_info_for_config)
from cluster.structured_output.matcher import StructuredOutputManager
from cluster.structured_output.validate import GrammarSpec, choice_ebnf, grammar_spec, validate_structured_outputs

__all__ = ["GrammarCompileService", "GrammarSpec", "StructuredOutputManager", "choice_ebnf", "grammar_spec",
           "make_tokenizer_info", "tokenizer_info_for", "tokenizer_info_for_config", "validate_structured_outputs"]
