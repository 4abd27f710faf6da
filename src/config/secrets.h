/*-------------------------------------------------------------------------
 *
 * secrets.h
 *	  The hooks that keep the secrets of outbox.kafka_properties out of the
 *	  server log, pg_stat_activity and pg_stat_statements.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_SECRETS_H
#define OUTBOX_SECRETS_H

#include "tcop/utility.h"
#include "utils/elog.h"

extern emit_log_hook_type outbox_prev_emit_log_hook;
extern ProcessUtility_hook_type outbox_prev_process_utility_hook;

extern void outbox_emit_log_hook(ErrorData *edata);
extern void outbox_process_utility(PlannedStmt *pstmt, const char *queryString,
								   bool readOnlyTree,
								   ProcessUtilityContext context,
								   ParamListInfo params,
								   QueryEnvironment *queryEnv,
								   DestReceiver *dest, QueryCompletion *qc);
extern void outbox_check_preload_order(void);
extern void outbox_kafka_scrub_secrets(char *text, size_t size,
									   const char *properties);

#endif							/* OUTBOX_SECRETS_H */
