#!/usr/bin/env bash
# trial-secrets.sh - the Secrets the secure base needs, for a TRIAL: a throwaway CA, a
# server certificate for the tqkv Services and pods, and bearer tokens. Production: issue
# the certificate with cert-manager (overlays/cert-manager) or your PKI, and manage the
# token file like any other secret.
#
#   deploy/k8s/trial-secrets.sh [--namespace NS] [--out DIR] [--apply] [--tokens-only]
#
# Writes into DIR (default: a new directory under /tmp, mode 0700):
#   ca.crt, ca.key      the trial CA (clients verify the server against ca.crt)
#   tls.crt, tls.key    the server certificate (ECDSA P-256, 90 days) for tqkv,
#                       tqkv-headless and *.tqkv-headless in NS (short and FQDN forms),
#                       localhost and 127.0.0.1
#                       (server and client use: peers present it to each other)
#   tokens              the server's token file: an admin token (rw on every namespace),
#                       a bench token (rw on the namespace "bench") and the peer token
#                       (rw on every namespace: the hand-off puts every namespace's pages)
#   admin-token, bench-token   the tokens alone, for clients
#   peer-token          the peer token alone, for the servers (TQKV_PEER_TOKEN_FILE)
# --apply creates or updates, in NS, the Secret tqkv-tls (type kubernetes.io/tls, with
# ca.crt) and the Secret tqkv-auth (tokens, bench-token, peer-token) with kubectl; running it again
# rotates everything, and the servers reload without a restart. --tokens-only skips the
# certificate (cert-manager makes it). Needs openssl (and kubectl for --apply).
set -euo pipefail

ns=tqkv
out=""
apply=0
tokens_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --namespace) ns=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --apply) apply=1; shift ;;
    --tokens-only) tokens_only=1; shift ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "trial-secrets.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "trial-secrets.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }
if [ "$apply" = 1 ]; then
  command -v kubectl >/dev/null || { echo "trial-secrets.sh: kubectl not found" >&2; exit 1; }
fi
case "$ns" in
  *[!a-z0-9-]*|"") echo "trial-secrets.sh: bad namespace '$ns'" >&2; exit 2 ;;
esac
if [ -z "$out" ]; then
  out=$(mktemp -d /tmp/tqkv-trial-secrets.XXXXXX)
fi
mkdir -p "$out"
chmod 700 "$out"
umask 077
cd "$out"

if [ "$tokens_only" = 0 ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key \
    -out ca.crt -days 365 -subj "/CN=tqkv trial CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key -out tls.csr \
    -subj "/CN=tqkv.$ns.svc" 2>/dev/null
  san="DNS:tqkv,DNS:tqkv.$ns,DNS:tqkv.$ns.svc,DNS:tqkv.$ns.svc.cluster.local"
  san="$san,DNS:tqkv-headless,DNS:tqkv-headless.$ns.svc"
  san="$san,DNS:*.tqkv-headless,DNS:*.tqkv-headless.$ns,DNS:*.tqkv-headless.$ns.svc"
  san="$san,DNS:*.tqkv-headless.$ns.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n' \
    "$san" > tls.ext
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt \
    -days 90 -extfile tls.ext 2>/dev/null
  rm -f tls.csr tls.ext ca.srl
  openssl verify -CAfile ca.crt tls.crt >/dev/null
fi

admin=$(openssl rand -hex 32)
bench=$(openssl rand -hex 32)
peer=$(openssl rand -hex 32)
printf '%s\n' "$admin" > admin-token
printf '%s\n' "$bench" > bench-token
printf '%s\n' "$peer" > peer-token
{
  echo "# tqkv bearer tokens: TOKEN r|w|rw NAMESPACE[,NAMESPACE...] ('*' = every namespace)"
  echo "$admin rw *"
  echo "$bench rw bench"
  echo "# the servers' own token (hand-off to peers on drain; TQKV_PEER_TOKEN_FILE)"
  echo "$peer rw *"
} > tokens

if [ "$apply" = 1 ]; then
  if [ "$tokens_only" = 0 ]; then
    kubectl -n "$ns" create secret generic tqkv-tls --type=kubernetes.io/tls \
      --from-file=tls.crt --from-file=tls.key --from-file=ca.crt \
      --dry-run=client -o yaml | kubectl apply -f -
  fi
  kubectl -n "$ns" create secret generic tqkv-auth --from-file=tokens \
    --from-file=bench-token=bench-token --from-file=peer-token=peer-token \
    --dry-run=client -o yaml | kubectl apply -f -
fi
echo "trial-secrets.sh: wrote $out ($( [ "$tokens_only" = 0 ] && echo 'ca.crt tls.crt tls.key ' )tokens admin-token bench-token peer-token)"
echo "trial-secrets.sh: clients verify with ca.crt and send 'authorization: Bearer <token>'"
