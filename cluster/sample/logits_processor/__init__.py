"""vLLM V1-compatible logits processors: a processor written for
`vllm.v1.sample.logits_processor` moves here by changing its import lines only."""
from cluster.sample.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from cluster.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor, process_dict_updates)
from cluster.sample.logits_processor.interface import (AddedRequest, BatchUpdate, LogitsProcessor,
                                                       MovedRequest, MoveDirectionality,
                                                       RemovedRequest, SpecDecodeMetadata)
from cluster.sample.logits_processor.load import (ENTRY_POINT_GROUP, build_logitsprocs,
                                                  check_spec_decode_support, load_custom_logitsprocs,
                                                  validate_request_params)
from cluster.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors

__all__ = [
    "AddedRequest", "AdapterLogitsProcessor", "BatchUpdate", "BatchUpdateBuilder",
    "ENTRY_POINT_GROUP", "LogitBiasLogitsProcessor", "LogitsProcessor", "LogitsProcessors",
    "MinPLogitsProcessor", "MinTokensLogitsProcessor", "MovedRequest", "MoveDirectionality",
    "RemovedRequest", "RequestLogitsProcessor", "SpecDecodeMetadata", "build_logitsprocs",
    "check_spec_decode_support", "load_custom_logitsprocs", "process_dict_updates",
    "validate_request_params",
]
