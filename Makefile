# Makefile for the outbox extension (PGXS)
#
#   make && make install        build and install into the PostgreSQL that pg_config names
#   make installcheck           pg_regress tests against a running server (see test/run.sh)
#   make dist                   the PGXN distribution outbox-<version>.zip of the committed tree
#
# Any PostgreSQL from 15 to 18: make PG_CONFIG=/path/to/bin/pg_config (then make clean
# before building for another major: object files are not major-aware).

EXTENSION = outbox
MODULE_big = outbox
# in data-path order: start-up, settings, the write side, the relay
# process, the state both sides share
OBJS = \
	src/outbox.o \
	src/guc.o \
	src/topic.o \
	src/kafka_config.o \
	src/secrets.o \
	src/emit.o \
	src/capture.o \
	src/ops.o \
	src/worker.o \
	src/relay.o \
	src/producer.o \
	src/shmem.o \
	src/status.o

DATA = $(wildcard sql/outbox--*.sql)
PGFILEDESC = "outbox - transactional outbox relayed to Apache Kafka"

SHLIB_LINK += -lrdkafka
PG_CPPFLAGS += -I$(srcdir)/src
PG_CFLAGS += -Wextra -Wno-unused-parameter -Wno-missing-field-initializers -Wno-sign-compare

# pg_regress reads test/sql/*.sql; test/expected is a link to the top-level expected/
REGRESS = emit capture ops
REGRESS_OPTS = --inputdir=test --outputdir=test/out

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

EXTRA_CLEAN = test/out

# PGXS tracks no header dependencies unless PostgreSQL was built with
# --enable-depend: rebuild everything when a header changes.
$(OBJS): $(wildcard $(srcdir)/src/*.h)

# PGXN distribution (META.json): a zip of HEAD named after META.json's version
DISTVERSION = $(shell sed -n 's/^   "version": "\(.*\)",$$/\1/p' $(srcdir)/META.json)
DISTDIR ?= .

dist:
	git archive --format=zip --prefix=$(EXTENSION)-$(DISTVERSION)/ \
		-o $(DISTDIR)/$(EXTENSION)-$(DISTVERSION).zip HEAD

.PHONY: dist
