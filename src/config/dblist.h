/*-------------------------------------------------------------------------
 *
 * dblist.h
 *	  Which databases get a relay: outbox.databases, and the databases of
 *	  the cluster as the launcher sees them (dblist.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_DBLIST_H
#define OUTBOX_DBLIST_H

#include "nodes/pg_list.h"
#include "utils/guc.h"

/* one row of pg_database */
typedef struct OutboxDatabase
{
	Oid			oid;
	char		name[NAMEDATALEN];
	bool		allow_connections;	/* datallowconn */
	bool		is_template;	/* datistemplate */
} OutboxDatabase;

/* outbox.databases (and outbox.database): check hooks, the names relayed */
extern bool outbox_check_database(char **newval, void **extra,
								  GucSource source);
extern bool outbox_check_databases(char **newval, void **extra,
								   GucSource source);
extern List *outbox_relayed_databases(bool *all);
extern bool outbox_database_relayed(const char *name);

extern OutboxDatabase *outbox_scan_databases(int *count);

#endif							/* OUTBOX_DBLIST_H */
