"""Configuration of the research tools (the `[tools]` table of dxr.toml, env `DXR_TOOLS__...`).

Secrets never live here: providers name the environment variable that holds their key.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from dxr.settings_model import SettingsModel
from tools.embeddings import EmbeddingConfig

# Words whose presence marks a page as medical; a page needs `min_medical_terms` distinct ones.
MEDICAL_TERMS = (
    "patient", "patients", "clinical", "disease", "diagnosis", "treatment", "therapy", "symptom", "symptoms",
    "syndrome", "chronic", "acute", "infection", "cancer", "tumor", "surgery", "surgical", "medication",
    "drug", "dose", "hospital", "mortality", "morbidity", "risk", "prognosis", "incidence", "prevalence",
    "complication", "complications", "recurrence", "disorder", "cardiac", "renal", "pulmonary", "diabetes",
    "hypertension", "failure", "injury", "blood", "cohort", "trial", "pathology", "physician", "care",
)


class SerpMapping(SettingsModel):
    """Where a generic SERP-JSON provider puts things (dotted paths into its response)."""

    query_param: str = "q"
    results_path: str = Field("results", description="dotted path to the result list, e.g. web.results")
    title_field: str = "title"
    url_field: str = "url"
    snippet_field: str = "snippet"
    key_header: str | None = Field(None, description="HTTP header carrying the key (e.g. X-Subscription-Token)")
    key_param: str | None = Field(None, description="query parameter carrying the key (e.g. api_key)")
    extra_params: dict[str, str] = Field(default_factory=dict, description="fixed query parameters")
    # Some APIs leave the result list out when nothing matched (Brave omits `web`): an answer without the list
    # whose top-level fields have these values is then zero hits; any other answer without it is an error.
    envelope: dict[str, str] = Field(default_factory=dict,
                                     description="top-level fields of a well-formed answer, e.g. {type = 'search'}")


class WebConfig(SettingsModel):
    provider: str = Field("none", pattern="^(none|searxng|brave|serp_json)$")
    endpoint: str | None = Field(None, description="provider URL (SearXNG base, Brave/SERP search URL)")
    api_key_env: str | None = Field(None, description="environment variable holding the provider key")
    mapping: SerpMapping = SerpMapping()
    # Providers are called one at a time with at least this gap (public APIs throttle hard).
    min_interval_seconds: float = Field(1.0, ge=0)
    results_per_query: int = Field(5, ge=1, le=50, description="SERP hits opened by the reader per query")
    max_depth: int = Field(5, ge=0, le=5, description="link-following depth (spec: at most 5)")
    max_sublinks: int = Field(10, ge=0, le=10, description="eligible sublinks followed per page (spec: at most 10)")
    max_pages_per_job: int = Field(30, ge=1, description="hard cap of page reads per search job")
    stop_on_support: bool = Field(True, description="stop reading inside a job once a page shows a support cue")
    timeout_seconds: float = Field(10.0, gt=0)
    max_bytes: int = Field(2_000_000, ge=1024, description="larger pages are rejected as oversized")
    content_types: tuple[str, ...] = ("text/html", "application/xhtml+xml", "text/plain")
    # Per-domain politeness: the gap between two requests to the same host.
    per_domain_interval_seconds: float = Field(0.5, ge=0)
    concurrency: int = Field(4, ge=1, description="page reads in flight")
    user_agent: str = "dxr-research-reader/0.1 (+offline-first research tool)"
    blocked_domains: tuple[str, ...] = ("facebook.com", "twitter.com", "x.com", "instagram.com", "tiktok.com",
                                         "pinterest.com", "reddit.com")
    # Hosts (exact names or IP addresses, no port) the reader may read although they resolve to a loopback,
    # private, link-local or otherwise non-public address; any other such host is refused (SSRF). Empty by
    # default: pages and their links are untrusted, and internal services must not end up in the ledger.
    allow_private_hosts: tuple[str, ...] = ()
    medical_terms: tuple[str, ...] = MEDICAL_TERMS
    min_medical_terms: int = Field(3, ge=0)
    min_chars: int = Field(200, ge=0, description="pages with less extracted text are rejected as near-empty")
    passage_chars: int = Field(700, ge=100)


class ToolsConfig(SettingsModel):
    corpus_dir: Path | None = Field(None, description="index root; default <data_dir>/forecast/corpus")
    chunk_chars: int = Field(1000, ge=200, description="chunk size; ~250 tokens fits MiniLM's window")
    embedding: EmbeddingConfig = EmbeddingConfig()
    web: WebConfig = WebConfig()
    # Longest run of consecutive record words a query may copy (the sanitizer cuts longer runs).
    max_verbatim_words: int = Field(6, ge=2)
    # A page or passage shows a support cue when its entity+endpoint overlap score reaches this.
    support_threshold: float = Field(0.5, ge=0, le=1)
