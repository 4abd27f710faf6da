/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  The differences between the PostgreSQL majors outbox supports (15 to
 *	  18), in one place.  Each #if names the release that changed what.
 *
 * Every other file is written against the newest API and includes this
 * header (through outbox.h) instead of testing PG_VERSION_NUM itself.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_COMPAT_H
#define OUTBOX_COMPAT_H

#include "postgres.h"

#if PG_VERSION_NUM < 150000
#error "outbox needs PostgreSQL 15 or later"
#endif

/*
 * PostgreSQL 16 keeps GUC string values and check-hook extras in a memory
 * context of its own: a check hook that replaces *newval or sets *extra must
 * allocate them with guc_malloc()/guc_strdup() and release them with
 * guc_free(); the libc functions make the postmaster abort at start.  15
 * free()s them with libc.  With elevel LOG both return NULL on failure
 * instead of throwing, as a check hook needs.
 */
#if PG_VERSION_NUM >= 160000
#define outbox_guc_malloc(size)		guc_malloc(LOG, (size))
#define outbox_guc_strdup(s)		guc_strdup(LOG, (s))
#define outbox_guc_free(p)			guc_free(p)
#else
#define outbox_guc_malloc(size)		malloc(size)
#define outbox_guc_strdup(s)		strdup(s)
#define outbox_guc_free(p)			free(p)
#endif

/*
 * PostgreSQL 18 dropped pg_attribute_noreturn(), written after the
 * declarator, for pg_noreturn, written before the declaration.  Before 18
 * the attribute is accepted in that place too.
 */
#ifndef pg_noreturn
#define pg_noreturn pg_attribute_noreturn()
#endif

/*
 * PostgreSQL 17 lets an extension name its wait events
 * (WaitEventExtensionNew): pg_stat_activity.wait_event then says what the
 * relay waits for instead of the generic "Extension" that 15 and 16 show.
 */
#include "utils/wait_event.h"
#if PG_VERSION_NUM >= 170000
#define outbox_new_wait_event(name)	WaitEventExtensionNew(name)
#else
#define outbox_new_wait_event(name)	((void) (name), PG_WAIT_EXTENSION)
#endif

/*
 * PostgreSQL 17 added transaction_timeout, which also ends background
 * workers' transactions (FATAL).  The relay turns it off for itself (see
 * outbox_worker_main); before 17 there is nothing to turn off.
 */
#if PG_VERSION_NUM >= 170000
#define outbox_disable_transaction_timeout() \
	SetConfigOption("transaction_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE)
#else
#define outbox_disable_transaction_timeout() ((void) 0)
#endif

/*
 * PostgreSQL 16 replaced the per-kind ownership and privilege checks such
 * as pg_database_ownercheck() and pg_namespace_aclcheck() with
 * object_ownercheck() and object_aclcheck().
 */
#include "utils/acl.h"
#if PG_VERSION_NUM >= 160000
#define outbox_database_ownercheck(dboid, roleid) \
	object_ownercheck(DatabaseRelationId, (dboid), (roleid))
#define outbox_namespace_aclcheck(nspoid, roleid, mode) \
	object_aclcheck(NamespaceRelationId, (nspoid), (roleid), (mode))
#define outbox_proc_aclcheck(procoid, roleid, mode) \
	object_aclcheck(ProcedureRelationId, (procoid), (roleid), (mode))
#define outbox_extension_ownercheck(extoid, roleid) \
	object_ownercheck(ExtensionRelationId, (extoid), (roleid))
#else
#define outbox_database_ownercheck(dboid, roleid) \
	pg_database_ownercheck((dboid), (roleid))
#define outbox_namespace_aclcheck(nspoid, roleid, mode) \
	pg_namespace_aclcheck((nspoid), (roleid), (mode))
#define outbox_proc_aclcheck(procoid, roleid, mode) \
	pg_proc_aclcheck((procoid), (roleid), (mode))
#define outbox_extension_ownercheck(extoid, roleid) \
	pg_extension_ownercheck((extoid), (roleid))
#endif

/*
 * PostgreSQL 16 added soft errors: an input function can refuse a value
 * without raising ERROR (DirectInputFunctionCallSafe).  The inbox reads a
 * Kafka value as jsonb when it is JSON and keeps the bytes otherwise
 * (src/inbox/inbox_event.c).  On 15, the value is first checked by the JSON
 * lexer, which returns its verdict (escapes decoded, so \u0000 is refused
 * as jsonb would); jsonb_in then only fails on what the lexer cannot see, a
 * number beyond numeric's range, as an ERROR.
 */
#include "fmgr.h"
#include "utils/fmgrprotos.h"
#if PG_VERSION_NUM >= 160000
#include "nodes/miscnodes.h"
static inline bool
outbox_jsonb_in_safe(char *str, size_t len, Datum *result)
{
	ErrorSaveContext escontext;

	(void) len;
	memset(&escontext, 0, sizeof(escontext));
	escontext.type = T_ErrorSaveContext;
	return DirectInputFunctionCallSafe(jsonb_in, str, InvalidOid, -1,
									   (Node *) &escontext, result);
}
#else
#include "common/jsonapi.h"
#include "mb/pg_wchar.h"
static inline bool
outbox_jsonb_in_safe(char *str, size_t len, Datum *result)
{
	JsonLexContext *lex = makeJsonLexContextCstringLen(str, (int) len,
													   GetDatabaseEncoding(), true);

	if (pg_parse_json(lex, &nullSemAction) != JSON_SUCCESS)
		return false;
	*result = DirectFunctionCall1(jsonb_in, CStringGetDatum(str));
	return true;
}
#endif

#endif							/* OUTBOX_COMPAT_H */
