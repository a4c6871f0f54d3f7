"""deploy/kubernetes/extract-indexed-job.yaml, offline: the Job passes Kubernetes 1.30's strict
schema; it is Indexed, each index's slice of the corpus and its own dataset named by
``$(JOB_COMPLETION_INDEX)``, every run ``--resume``; the failures it retries and those it does
not are extract's exit statuses; its command line is one extract's own parser takes; its URL and
API key Secret are those the Helm chart renders for the release it names; no credential is on
its command line."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.commands import REPO, chart_manifests
from tests.deploy.deploy_helpers import env_of, objects_of, only
from tests.doc_blocks import EXTRACT, marked
from vllm_hidden_state_proxy.cli import build_parser
from vllm_hidden_state_proxy.extract import runner
from vllm_hidden_state_proxy.extract.options import options_from_arguments

JOB_FILE = REPO / "deploy" / "kubernetes" / "extract-indexed-job.yaml"
RELEASE = "hsp"
INDEX = "$(JOB_COMPLETION_INDEX)"


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    (document,) = [doc for doc in yaml.safe_load_all(JOB_FILE.read_text()) if doc]
    assert isinstance(document, dict)
    return document


def _container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_the_job_passes_kubernetes_schemas(job: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(job, "1.30", strict=True) == "1.30"


def test_each_index_reads_its_slice_and_writes_its_own_dataset(job: dict[str, Any]) -> None:
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] <= spec["completions"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    container = _container(job)
    argv = [*container["command"][1:], *container["args"]]
    assert container["command"][0] == "hidden-state-proxy"
    for index in ("0", "7"):
        args = build_parser().parse_args([a.replace(INDEX, index) for a in argv])
        options = options_from_arguments(args)
        assert args.command == "extract"
        assert args.input == f"s3://corpora/shards/shard-{index}.jsonl"
        assert options.output == f"s3://datasets/states/shard={index}/"
        assert options.resume  # a retried pod sends only what its dataset lacks
    # The pods' requests together stay within what one proxy takes by default (half its 1024
    # front-server connections).
    concurrency = int(argv[argv.index("--concurrency") + 1])
    assert spec["parallelism"] * concurrency <= 512


def test_it_fails_an_index_at_once_only_where_a_retry_cannot_help(job: dict[str, Any]) -> None:
    spec = job["spec"]
    assert spec["backoffLimitPerIndex"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailIndex"]
    (codes,) = [r["onExitCodes"] for r in fail]
    assert codes["containerName"] == _container(job)["name"]
    assert codes["operator"] == "In"
    assert sorted(codes["values"]) == [runner.EXIT_FAILED, runner.EXIT_SETUP]
    # Retried (with --resume): stopped, interrupted (SIGTERM), killed.
    assert not {runner.EXIT_STOPPED, runner.EXIT_INTERRUPTED, 137} & set(codes["values"])
    assert [r["onPodConditions"] for r in rules if r["action"] == "Ignore"] == [
        [{"type": "DisruptionTarget", "status": "True"}]
    ]


def test_its_url_and_api_key_are_the_charts_for_its_release(job: dict[str, Any]) -> None:
    objects = objects_of(chart_manifests(release=RELEASE, namespace="ns"))
    service = only(objects, "Service")
    port = service["spec"]["ports"][0]["port"]
    container = _container(job)
    args = container["args"]
    assert args[args.index("--url") + 1] == f"http://{service['metadata']['name']}:{port}"
    key = env_of(container)["HIDDEN_STATE_PROXY_API_KEY"]["secretKeyRef"]
    (secret,) = [
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == key["name"]
    ]
    assert key["key"] in secret["data"]


def test_no_credential_is_on_its_command_line(job: dict[str, Any]) -> None:
    container = _container(job)
    words = " ".join([*container["command"], *container["args"]]).lower()
    for secretish in ("aws_", "key", "secret", "token", "password", "@"):
        assert secretish not in words, secretish
    assert container["envFrom"][0]["secretRef"]["name"]


def test_the_pages_commands_make_its_slices_and_wait_for_it(job: dict[str, Any]) -> None:
    """docs/extract.md splits the corpus into as many slices as the Job has indices, named as
    its INPUT reads them, applies this file and waits for this Job."""
    (block,) = marked("kubernetes", EXTRACT)
    assert f'% {job["spec"]["completions"]} ".jsonl"' in block.code
    assert "s3://corpora/shards/" in block.code and '"shard-"' in block.code
    assert f"-f {JOB_FILE.relative_to(REPO)}" in block.code
    assert f"job/{job['metadata']['name']}" in block.code
