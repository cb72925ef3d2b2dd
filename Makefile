# Convenience wrappers around scripts/dev.sh (the README's two commands).
.PHONY: setup train test test-all bench
setup:
	bash scripts/dev.sh setup
train:
	bash scripts/dev.sh train $(ARGS)
test:
	bash scripts/dev.sh test $(ARGS)
test-all:
	bash scripts/dev.sh test -m "" $(ARGS)
