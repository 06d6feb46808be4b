#!/usr/bin/python3
"""Rejects fields the Kubernetes API does not define (strict decoding).

Usage: strict_fields.py MANIFESTS.yaml

The JSON-schema check (validate.js) accepts unknown fields, because the
Kubernetes OpenAPI schemas allow them; the API server drops them silently
(or, with strict field validation, rejects them). A misspelt key in a
template (`livenessprobe:`, `nodeselector:`) would thus pass unnoticed. This
walks every object of a core Kubernetes kind through the model classes of the
Kubernetes Python client (Debian's python3-kubernetes), which list each
type's fields, and reports every key that is not one of them, with its path.
Custom resources (ServiceMonitor) are skipped. Exits 1 on any unknown field.
"""
import re
import sys

import yaml

try:
    import kubernetes.client as k8s
except ImportError:
    sys.exit("strict_fields.py: the Kubernetes Python client is missing: install python3-kubernetes "
             "(scripts/install_deps.sh)")

# apiVersion/kind -> model class name (the client's naming: V1DaemonSet, ...).
def model_name(api_version, kind):
    version = api_version.split("/")[-1]
    return version[0].upper() + version[1:] + kind


def walk(value, type_name, path, errors):
    if value is None:
        return
    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        if isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, m.group(1), f"{path}[{i}]", errors)
        return
    m = re.fullmatch(r"dict\(str, (.+)\)", type_name)
    if m:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, m.group(1), f"{path}.{key}", errors)
        return
    model = getattr(k8s, type_name, None)
    if model is None or not hasattr(model, "attribute_map"):
        return  # str, int, bool, object, datetime, ...: nothing to look inside
    if not isinstance(value, dict):
        return
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        attr = by_json_name.get(key)
        if attr is None:
            close = [n for n in by_json_name if n.lower() == key.lower()]
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            errors.append(f"{path}.{key}: not a field of {type_name}{hint}")
            continue
        walk(item, model.openapi_types[attr], f"{path}.{key}", errors)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors, checked, skipped = [], 0, 0
    for obj in docs:
        name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        model = model_name(obj.get("apiVersion", ""), obj.get("kind", ""))
        if not hasattr(k8s, model):
            skipped += 1
            continue
        walk(obj, model, name, errors)
        checked += 1
    if errors:
        print(f"strict_fields: {len(errors)} unknown field(s):", file=sys.stderr)
        for e in errors:
            print(f"  - {e}", file=sys.stderr)
        return 1
    print(f"{checked} objects have only fields the Kubernetes API defines"
          + (f" ({skipped} custom resources not checked)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
