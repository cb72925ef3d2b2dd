# Convenience wrappers around scripts/dev.sh (the README's two commands).  Arguments go in ARGS:
#   make train ARGS="trainer.max_epochs=2"      make test ARGS="tests/test_cli.py"
# (make reads `key=value` words as its own variables and other words as targets, so they cannot pass through
# as they are: such a call stops with this hint instead of dropping them.)
.PHONY: setup train test test-all bench
OVERRIDES := $(filter-out ARGS=%,$(strip $(-*-command-variables-*-)))
ifneq ($(OVERRIDES),)
$(error make reads $(OVERRIDES) as its own variables: pass it to the command as ARGS="$(OVERRIDES)")
endif
ifneq ($(filter-out setup train test test-all,$(MAKECMDGOALS)),)
$(error make takes no extra words ($(filter-out setup train test test-all,$(MAKECMDGOALS))): pass them as ARGS="...")
endif
setup:
	bash scripts/dev.sh setup
train:
	bash scripts/dev.sh train $(ARGS)
test:
	bash scripts/dev.sh test $(ARGS)
test-all:
	bash scripts/dev.sh test -m "" $(ARGS)
