#!/bin/sh
# colocate's pod start command: the pod's TLS bundle from the environment to files on tmpfs, then vLLM.
#
# The provider hands the pod its certificate, key and client CA in one variable, COLOCATE_POD_TLS
# (colocate/pods/podtls.py: "\n" + certificate + key + client CA, in PEM). vLLM's --ssl-* flags take
# files; pointed at /proc/self/environ, OpenSSL can lose the bundle behind variables the provider
# puts ahead of it (RUNPOD_*, VAST_*: their order is not documented). This script writes the three
# parts to a private directory on tmpfs (/dev/shm: never the image's disk), drops the variable, and
# execs `vllm serve` with every `--ssl-* /proc/self/environ` argument pointed at its file instead.
# Other arguments pass through unchanged. Without COLOCATE_POD_TLS it execs vLLM as it was given.
# Baked in as the image's entrypoint by pod/Dockerfile; tests/test_pod_start.py runs it.
set -eu

environ=/proc/self/environ
if [ -n "${COLOCATE_POD_TLS:-}" ]; then
    base=/dev/shm
    if [ ! -d "$base" ] || [ ! -w "$base" ]; then base=${TMPDIR:-/tmp}; fi
    umask 077
    dir=$(mktemp -d "$base/colocate-tls.XXXXXX")
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
    unset COLOCATE_POD_TLS
    prev=
    for arg do
        shift
        given=$arg
        case "$prev $arg" in
            "--ssl-certfile $environ") arg="$dir/cert.pem" ;;
            "--ssl-keyfile $environ") arg="$dir/key.pem" ;;
            "--ssl-ca-certs $environ") arg="$dir/ca.pem" ;;
        esac
        set -- "$@" "$arg"
        prev=$given
    done
fi
exec vllm serve "$@"
