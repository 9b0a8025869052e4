#!/usr/bin/env bash
# Makes what a secure Fulcrum cluster needs, with openssl: a cluster CA, one
# certificate per member (coordinator, servers, workers) and a token file for
# the job API. Runs again are cheap: what exists is kept, what is missing is
# made, so a cluster's CA survives restarts.
#
#   gen-certs.sh DIR [--servers N] [--workers M] [--san SAN]... [--days D]
#                    [--user NAME]... [--renew]
#
#   DIR/ca.crt, ca.key                 the CA (keep ca.key off the cluster)
#   DIR/coordinator.crt, .key          spiffe://fulcrum/coordinator/coordinator
#   DIR/server-I.crt, .key             spiffe://fulcrum/server/server-I
#   DIR/worker-I.crt, .key             spiffe://fulcrum/worker/worker-I
#   DIR/tokens.csv                     the coordinator's --token_file: user
#                                      "admin" (group fulcrum:admins) and
#                                      each --user (default: "demo")
#   DIR/token-USER                     each user's token, for fulcrumctl
#                                      --token_file / $FULCRUM_TOKEN_FILE
#
# Every certificate names localhost and 127.0.0.1; --san adds more (e.g.
# --san 'DNS:*.fulcrum-server.fulcrum.svc.cluster.local' --san IP:10.0.0.5),
# since peers check that the address they dial is in the certificate.
# --renew issues every member certificate again from the same CA (rotation:
# running processes pick the new files up within --tls_refresh_s).
# Keys are EC P-256; files are mode 600.
set -euo pipefail

usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
(($#)) || usage
case "$1" in -h|--help|-*) usage ;; esac  # the first argument is the directory
dir=$1
shift
servers=2 workers=2 days=365 renew=0
sans=() users=()
while (($#)); do
  case "$1" in
    --servers) servers=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --san) sans+=("$2"); shift 2 ;;
    --days) days=$2; shift 2 ;;
    --user) users+=("$2"); shift 2 ;;
    --renew) renew=1; shift ;;
    -h|--help) usage ;;
    *) echo "gen-certs.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
((${#users[@]})) || users=(demo)
command -v openssl >/dev/null || { echo "gen-certs.sh: openssl is missing (apt-get install openssl)" >&2; exit 1; }

umask 077
mkdir -p "$dir"

if [[ ! -f "$dir/ca.crt" || ! -f "$dir/ca.key" ]]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$dir/ca.key" -sha256 -days $((days * 10)) -subj "/O=Fulcrum/CN=Fulcrum cluster CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.crt" 2>/dev/null
  echo "gen-certs.sh: new CA in $dir/ca.crt"
fi

# issue ROLE NAME: DIR/NAME.crt and DIR/NAME.key, written next to the old
# ones and renamed over them.
issue() {
  local role=$1 name=$2 san ext
  if [[ -f "$dir/$name.crt" && -f "$dir/$name.key" ]] && ((!renew)); then return 0; fi
  san="URI:spiffe://fulcrum/$role/$name,DNS:localhost,IP:127.0.0.1"
  for s in "${sans[@]}"; do san+=",$s"; done
  ext=$(mktemp)
  printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=$san" >"$ext"
  openssl ecparam -name prime256v1 -genkey -noout -out "$dir/$name.key.new" 2>/dev/null
  openssl req -new -key "$dir/$name.key.new" -subj "/O=Fulcrum/OU=$role/CN=$name" 2>/dev/null |
    openssl x509 -req -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
      -days "$days" -sha256 -extfile "$ext" -out "$dir/$name.crt.new" 2>/dev/null
  rm -f "$ext"
  mv "$dir/$name.key.new" "$dir/$name.key"
  mv "$dir/$name.crt.new" "$dir/$name.crt"
}

issue coordinator coordinator
for ((i = 0; i < servers; i++)); do issue server "server-$i"; done
for ((i = 0; i < workers; i++)); do issue worker "worker-$i"; done

# Tokens: kept once made; new users are appended.
touch "$dir/tokens.csv"
add_user() {
  local user=$1 groups=$2 token
  grep -q "^[^,]*,$user," "$dir/tokens.csv" && return 0
  token=$(openssl rand -hex 32)
  echo "$token,$user,$user${groups:+,\"$groups\"}" >>"$dir/tokens.csv"
  # No newline: gRPC clients send the file as a metadata value, and grpcio
  # refuses one that ends in a newline.
  printf %s "$token" >"$dir/token-$user"
}
add_user admin fulcrum:admins
for u in "${users[@]}"; do add_user "$u" ""; done
echo "gen-certs.sh: $dir holds the CA, coordinator, $servers server and $workers worker certificate(s)" \
  "and tokens for: $(cut -d, -f2 "$dir/tokens.csv" | tr '\n' ' ')"
