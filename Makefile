# Each target bootstraps .venv itself (see scripts/bootstrap.sh).
VENV := .venv
PY := $(VENV)/bin/python
BOOT := $(VENV)/.bootstrapped
NATIVE_SRC := $(wildcard csrc/*.c csrc/*.h csrc/*.py csrc/launcher/*.c csrc/launcher/*.h csrc/connect/*.c) pyproject.toml setup.py
VMTEST ?= ../shared/vmtest/vmtest.sh

.PHONY: run test test-vm bench lint clean native install

$(BOOT): $(NATIVE_SRC) scripts/bootstrap.sh pyproject.toml
	@./scripts/bootstrap.sh

native: $(BOOT)

run: $(BOOT)
	@$(PY) -m stockade.demo

test: $(BOOT)
	@./scripts/test-tools.sh
	$(PY) -m pytest -q tests

# Kernel-specific tests under a second kernel (Debian 6.1: cgroup v2, Landlock ABI 2).
test-vm: $(BOOT)
	./scripts/test-vm.sh

# A user install (pipx-style venv + $(PREFIX)/bin/stockade); PREFIX defaults to ~/.local (root: /usr/local).
install: $(BOOT)
	@./scripts/install.sh

bench: $(BOOT)
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; } || true
	@$(PY) -m compileall -q src >/dev/null
	$(PY) -m benchmarks

lint: $(BOOT)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build src/stockade/_native*.so src/stockade/_native.c *.egg-info src/*.egg-info
