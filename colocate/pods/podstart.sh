#!/bin/sh
# colocate's pod start command: the pod's TLS bundle from the environment, the pod's guard, then vLLM.
#
# The provider hands the pod its certificate, key and client CA in one variable, COLOCATE_POD_TLS
# (colocate/pods/podtls.py: "\n" + certificate + key + client CA, in PEM). vLLM's --ssl-* flags take
# files; pointed at /proc/self/environ, OpenSSL can lose the bundle behind variables the provider
# puts ahead of it (RUNPOD_*, VAST_*: their order is not documented). This script writes the three
# parts to a private directory on tmpfs (/dev/shm: never the image's disk), opens each on a file
# descriptor vLLM inherits, removes the directory, drops the variable, and execs `vllm serve` with
# every `--ssl-* /proc/self/environ` argument pointed at /proc/self/fd/N instead: vLLM reads the open
# files, nothing is left on any filesystem, and the key's last copy goes with vLLM's process however
# it ends (a signal, SIGKILL included). vLLM is exec'd, so signals reach it as they would unwrapped.
# Other arguments pass through unchanged. Without COLOCATE_POD_TLS only the guard is added.
#
# The guard (guard/colocate_pod_guard.py beside this script, put on PYTHONPATH here) is vLLM's
# --middleware: only the router's routes, only with the pod token (docs/pods.md, "The pod's guard").
# Baked in as the image's entrypoint by pod/Dockerfile; tests/test_pod_start.py runs it.
set -eu

here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)
PYTHONPATH="$here/guard${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
environ=/proc/self/environ
if [ -n "${COLOCATE_POD_TLS:-}" ]; then
    base=/dev/shm
    if [ ! -d "$base" ] || [ ! -w "$base" ]; then base=${TMPDIR:-/tmp}; fi
    umask 077
    dir=$(mktemp -d "$base/colocate-tls.XXXXXX")
    trap 'rm -rf "$dir"' EXIT
    trap 'exit 129' HUP
    trap 'exit 130' INT
    trap 'exit 143' TERM
    # Certificates before the key are the pod's (its chain may follow it); the key; certificates after it are CAs.
    printf '%s\n' "$COLOCATE_POD_TLS" | awk -v d="$dir" '
        /^-----BEGIN / {
            if ($0 ~ /PRIVATE KEY-----$/) { out = d "/key.pem"; keyed = 1 }
            else if (keyed) { out = d "/ca.pem" } else { out = d "/cert.pem" }
            inside = 1
        }
        inside { print > out }
        /^-----END / { inside = 0 }'
    for part in cert key ca; do
        if [ ! -s "$dir/$part.pem" ]; then
            echo "colocate-pod-start: COLOCATE_POD_TLS holds no $part in PEM; fix: set it to podtls.bundle(certificate, key, client CA)" >&2
            exit 78
        fi
    done
    exec 3<"$dir/cert.pem" 4<"$dir/key.pem" 5<"$dir/ca.pem"
    rm -rf "$dir"
    trap - EXIT HUP INT TERM
    unset COLOCATE_POD_TLS
    prev=
    for arg do
        shift
        given=$arg
        case "$prev $arg" in
            "--ssl-certfile $environ") arg=/proc/self/fd/3 ;;
            "--ssl-keyfile $environ") arg=/proc/self/fd/4 ;;
            "--ssl-ca-certs $environ") arg=/proc/self/fd/5 ;;
        esac
        set -- "$@" "$arg"
        prev=$given
    done
fi
exec vllm serve "$@" --middleware colocate_pod_guard.PodGuard
