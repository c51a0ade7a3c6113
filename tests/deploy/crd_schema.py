"""A CRD's openAPIV3Schema as the strict JSON schema kubeconform validates against.

kubeconform (not packaged for PyPI, npm or Debian) validates custom resources with JSON
schemas made from their CRDs by its openapi2jsonschema script in strict mode: every object
that lists its properties admits no others. This module makes the same conversion, so the
project's jsonschema validates InferencePools and HTTPRoutes the way kubeconform would.

    python -m tests.deploy.crd_schema CRD.yaml VERSION OUT.json "SOURCE"

writes one converted schema, with SOURCE (repository, path and release of the CRD) recorded
under "$comment". tests/fixtures/inference-extension/ holds the committed ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strict(node: Any) -> Any:
    """Each object schema with properties and no additionalProperties admits no other key;
    x-kubernetes-int-or-string becomes the union kubeconform writes."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    # Descriptions and CEL rules (x-kubernetes-validations: kubeconform does not run them
    # either) are left out: the fixture keeps only what validation reads.
    skip = {"description", "x-kubernetes-validations"}
    out = {key: strict(value) for key, value in node.items() if key not in skip}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["oneOf"] = [{"type": "string"}, {"type": "integer"}]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def crd_to_jsonschema(crd: dict[str, Any], version: str, source: str) -> dict[str, Any]:
    spec = crd["spec"]
    served = [v for v in spec["versions"] if v["name"] == version]
    if not served:
        raise ValueError(f"{spec['names']['kind']} has no version {version}")
    schema: dict[str, Any] = strict(served[0]["schema"]["openAPIV3Schema"])
    props = schema.setdefault("properties", {})
    # Metadata is the API server's (ObjectMeta): an object, not this CRD's to describe.
    props["metadata"] = {"type": "object"}
    props["apiVersion"] = {"enum": [f"{spec['group']}/{version}"]}
    props["kind"] = {"enum": [spec["names"]["kind"]]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
    return {"$comment": source, **schema}


def main(argv: list[str]) -> int:
    crd_path, version, out, source = argv
    crd = yaml.safe_load(Path(crd_path).read_text())
    schema = crd_to_jsonschema(crd, version, source)
    Path(out).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
