/*-------------------------------------------------------------------------
 *
 * connect.h
 *	  A relay worker's connection to its database (connect.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_CONNECT_H
#define OUTBOX_CONNECT_H

#include "config/dblist.h"

/* what the launcher hands a relay in bgw_extra (at most BGW_EXTRALEN bytes) */
typedef struct OutboxRelayArgs
{
	Oid			dboid;			/* database to connect to */
	Oid			roleoid;		/* outbox.role; InvalidOid = bootstrap superuser */
	char		dbname[NAMEDATALEN];	/* its name when the relay was started */
	int			worker;			/* index j of this relay, 0 .. nworkers - 1 */
	int			nworkers;		/* k: relays sharing the database's buckets */
} OutboxRelayArgs;

extern const char *outbox_connection_obstacle(const char *dbname,
											  const OutboxDatabase *db,
											  Oid *roleoid);
extern void outbox_connect_to_database(void);
extern bool outbox_relay_has_extension(void);
pg_noreturn extern void outbox_exit_without_extension(bool dropped);

#endif							/* OUTBOX_CONNECT_H */
