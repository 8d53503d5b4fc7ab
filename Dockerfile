# Images for tether-gateway and tether-agent (one Dockerfile, two targets):
#   docker build --target gateway -t ghcr.io/tether-tunnel/tether-gateway:0.1.0 .
#   docker build --target agent   -t ghcr.io/tether-tunnel/tether-agent:0.1.0 .
# Both run as uid 65532 on a read-only root filesystem, as the Helm charts expect. The agent image
# carries `ip` (iproute2) for the optional host-scoped address set-up (init container, NET_ADMIN).
# Note: the CI machines have no Docker engine, so these images are not built in CI.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tether-gateway -p tether-agent \
 && install -D -m 0755 target/release/tether-gateway /out/tether-gateway \
 && install -D -m 0755 target/release/tether-agent /out/tether-agent \
 && install -D -m 0755 nodeagent/scripts/setup-host-address.sh /out/setup-host-address.sh

FROM debian:bookworm-slim AS runtime-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
USER 65532:65532

FROM runtime-base AS gateway
COPY --from=build /out/tether-gateway /usr/local/bin/tether-gateway
ENTRYPOINT ["/usr/local/bin/tether-gateway"]

FROM debian:bookworm-slim AS agent
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/tether-agent /usr/local/bin/tether-agent
COPY --from=build /out/setup-host-address.sh /usr/local/bin/setup-host-address.sh
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tether-agent"]
